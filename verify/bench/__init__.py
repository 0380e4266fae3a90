"""GPU timings, a library: what `attnstep bench` (measure.py) runs against ceilings and PyTorch SDPA,
what `attnstep sweep` runs over a grid of shapes, and their reports, plots and goals. The commands
themselves are in verify/cli/ (bench.py, sweep.py, sdpa_outputs.py); nothing here imports them.
"""
