"""attnstep: step-by-step verification of CUDA attention code."""
__version__ = "0.1.0"
