"""The check engine: a run's stages compared with their float64 references within the error
model's bounds (compare.py), the bounds (tolerance.py, half_rounding.py), the references
(reference.py), the reference-free invariants, the per-head worker pool, and the report's records
(results.py). What differs between stages is in verify/specs/, the error model in verify/model/.
"""
