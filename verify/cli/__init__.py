"""The `attnstep` command line (group.py: the group and the entry point): generate, run, check, demo,
bench, sweep; options.py holds what the commands share; sdpa_outputs.py is the command that writes
PyTorch SDPA's results on a case (`python -m verify.cli.sdpa_outputs`).

Exit statuses: 0 every stage passes; 1 a stage fails; 2 bad usage or bad input (one line, no
traceback); 3 not enough memory (one line). `run` passes on the binary's own status (3: not enough
memory; 1: a CUDA failure).
"""
