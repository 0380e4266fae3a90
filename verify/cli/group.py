"""The `attnstep` group: every command of verify/cli/, and the console entry point."""
from __future__ import annotations

import importlib
import signal
import sys
from typing import Dict, List, Optional, Tuple

import click

# Each command: the module of verify/cli/ that defines it and its name there. A command's module is
# imported when the command runs (or --help lists it), so that `check` does not load what `bench`
# needs, and the reverse.
COMMANDS: Dict[str, Tuple[str, str]] = {
    "generate": ("generate", "generate"),
    "run": ("run", "run"),
    "check": ("check", "check"),
    "demo": ("run", "demo"),
    "bench": ("bench", "bench"),  # GPU timings against ceilings and PyTorch SDPA
    "sweep": ("sweep", "sweep"),  # the d × N grid of the stage path, flash and SDPA
}


class LazyGroup(click.Group):
    """A click group whose commands are imported from COMMANDS when first asked for."""

    def list_commands(self, ctx: click.Context) -> List[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> Optional[click.Command]:
        if name not in COMMANDS:
            return None
        module, attr = COMMANDS[name]
        return getattr(importlib.import_module(f"{__package__}.{module}"), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="attnstep", message="%(prog)s %(version)s")
def cli():
    """attnstep: find the stage where CUDA attention code goes wrong.

    Generate an input case, run the binary (CUDA or CPU backend) that writes every intermediate
    stage, and check each stage against a float64 NumPy reference.
    """


def main() -> None:  # console-script entry point
    """The group, with a Ctrl-C before a command has started (Python and click still loading it)
    ending as one there does: one line and 130, not click's "Aborted!" and 1, a failing check's;
    and a usage error (an unknown option, a bad value) in one line that names the command's help."""
    try:
        code = cli.main(prog_name="attnstep", standalone_mode=False)
    except click.UsageError as exc:  # (one line, not click's usage block: the command's help is named)
        where = exc.ctx.command_path if exc.ctx is not None else "attnstep"
        click.echo(f"Error: {exc.format_message()} (see {where} --help)", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.Abort:
        click.echo(f"Error: interrupted by signal {signal.SIGINT.value} (SIGINT)", err=True)
        sys.exit(128 + signal.SIGINT.value)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
