"""`python -m verify.cli.sdpa_outputs`: PyTorch's SDPA run on an input case at bf16/fp16, its results
written as another program's output folder for `attnstep check` (what runs, and why:
verify/bench/sdpa_outputs.py).

    python -m verify.cli.sdpa_outputs --in data/random_test --out data/sdpa_flash --backend flash --precision bf16
    attnstep check --in data/random_test --out data/sdpa_flash --precision bf16
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from ..bench.sdpa_outputs import BACKENDS, MASKS, BackendUnavailable, stage_arrays, write_sdpa_case
from ..stages import DEFAULT_INPUT_DIR, HALF_PRECISIONS
from .options import InputError, user_errors


@click.command()
@click.option("--in", "in_dir", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_INPUT_DIR,
              show_default=True, help="Input case (attnstep generate; dO for the gradients).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Folder for the stage files (one <stage>.npy each).")
@click.option("--backend", type=click.Choice(tuple(BACKENDS)), required=True,
              help="The SDPA backend to force (math-half: the math backend with fp16/bf16 reductions).")
@click.option("--precision", type=click.Choice(HALF_PRECISIONS), default=HALF_PRECISIONS[0], show_default=True,
              help="The format SDPA computes in.")
@click.option("--mask", type=click.Choice(MASKS), default=MASKS[0], show_default=True,
              help="For a causal case: torch's is_causal, or the same top-left mask as an attn_mask.")
@click.option("--scale", type=float, default=None,
              help="Scale SDPA uses instead of the case's (to see that a wrong scale fails the check).")
@user_errors
def main(in_dir: Path, out_dir: Path, backend: str, precision: str, mask: str, scale: Optional[float]) -> None:
    """Run PyTorch SDPA on the case IN at bf16/fp16 and write its results into OUT.

    Check them with `attnstep check --in IN --out OUT --precision PRECISION`. Exit status 1
    when torch cannot run BACKEND here (the reason torch gives is printed).
    """
    try:
        results = write_sdpa_case(in_dir, out_dir, backend, precision, mask, scale)
    except BackendUnavailable as exc:
        raise InputError(f"SDPA backend unavailable: {exc}", 1) from None
    for note in results.notes:
        click.echo(f"note: {note}", err=True)
    click.echo(f"SDPA {backend} {precision}: wrote {', '.join(stage_arrays(results, backend))} to {out_dir}")


if __name__ == "__main__":
    main()
