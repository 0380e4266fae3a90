#!/usr/bin/env python3
"""The classic course layout's entry point: `python scripts/verify.py [OPTIONS]` is `attnstep check`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from verify.cli.group import cli  # noqa: E402

if __name__ == "__main__":
    cli(["check", *sys.argv[1:]], prog_name="verify.py")
