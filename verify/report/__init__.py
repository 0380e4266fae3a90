"""Reports of a check: the terminal table (text.py), JSON (json_file.py), JUnit XML (junit.py) and
error heat maps (heatmaps.py), and what the verdict says of files written over a run, heads that
fail alike and half-precision values (states.py).
"""
