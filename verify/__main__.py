"""`python -m verify` is the `attnstep` command."""
from .cli import main

main()
