"""The `attnstep` group: every command of verify/cli/, and the console entry point."""
from __future__ import annotations

import click

from . import bench, check, generate, run, sweep


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="attnstep", message="%(prog)s %(version)s")
def cli():
    """attnstep: find the stage where CUDA attention code goes wrong.

    Generate an input case, run the binary (CUDA or CPU backend) that writes every intermediate
    stage, and check each stage against a float64 NumPy reference.
    """


cli.add_command(generate.generate)
cli.add_command(run.run)
cli.add_command(check.check)
cli.add_command(run.demo)
cli.add_command(bench.bench)  # GPU timings against ceilings and PyTorch SDPA
cli.add_command(sweep.sweep)  # the d × N grid of the stage path, flash and SDPA


def main() -> None:  # console-script entry point
    cli(prog_name="attnstep")


if __name__ == "__main__":
    main()
