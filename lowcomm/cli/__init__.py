"""The ``lowcomm`` command (click), a thin shell over :mod:`lowcomm.run` and :mod:`lowcomm.tools`."""
from .main import main

__all__ = ["main"]
