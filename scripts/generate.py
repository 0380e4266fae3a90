#!/usr/bin/env python3
"""The classic course layout's entry point: `python scripts/generate.py [OPTIONS]` is `attnstep generate`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from verify.cli.group import cli  # noqa: E402

if __name__ == "__main__":
    cli(["generate", *sys.argv[1:]], prog_name="generate.py")
