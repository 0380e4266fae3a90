"""Running programs: building with CMake and running the binary (runner.py), a run for `run` and
`demo` with its earlier outputs moved aside (watched.py), and the program checks of
`run --sanitize/--repeat` (repeats.py, sanitizer.py, program_checks.py).
"""
