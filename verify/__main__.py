"""`python -m verify` is the `attnstep` command."""
from .cli.group import main

main()
