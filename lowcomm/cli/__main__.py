"""``python -m lowcomm.cli``: what every rank of an mpirun job runs."""
from .main import main

main()
