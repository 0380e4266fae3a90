"""Bug diagnosis: hypotheses tested on a failing stage (hypotheses.py), each naming a pattern that
explains it; the backward, input, precision and region hypotheses one module each.
"""
