"""Other communication backends lowcomm can drive (Horovod)."""
