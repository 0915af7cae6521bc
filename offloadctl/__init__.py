"""offloadctl: train models whose optimizer state does not fit in GPU memory."""
__version__ = "0.1.0"
