"""GPU timings: `attnstep bench` (measure.py) against ceilings and PyTorch SDPA, `attnstep sweep`
over a grid of shapes, and their reports, plots and goals.
"""
