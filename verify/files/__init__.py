"""Files and cases: reading and writing matrices, manifests, input cases and stage files, and
the guards that keep a run's folders apart.
"""
