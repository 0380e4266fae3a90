"""`python -m verify.cli.sdpa_outputs`: PyTorch's SDPA (bf16/fp16) or FlexAttention (fp32, bf16,
fp16) run on an input case, its results written as another program's output folder for
`attnstep check` (what runs, and why: verify/bench/sdpa_outputs.py, verify/bench/flex_outputs.py).

    python -m verify.cli.sdpa_outputs --in data/random_test --out data/sdpa_flash --backend flash --precision bf16
    attnstep check --in data/random_test --out data/sdpa_flash --precision bf16

    python -m verify.cli.sdpa_outputs --in data/case --out data/flex --backend flex --precision bf16
    attnstep check --in data/case --out data/flex --precision bf16
    (an fp32 Flex run: check it with --precision fp32 --math fast; its exp2 is the GPU's approximate one)

A packed case is computed sequence by sequence (SDPA) or whole under a document mask (Flex); a
paged case on the keys gathered through its block table. --device cpu runs torch's CPU kernels
(SDPA's math and flash backends, Flex uncompiled).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from ..bench.flex_outputs import FLEX, FLEX_PRECISIONS, write_flex_case
from ..bench.foreign_outputs import BackendUnavailable, stage_arrays
from ..bench.sdpa_outputs import BACKENDS, DEVICES, MASKS, NATIVE, write_sdpa_case
from ..stages import DEFAULT_INPUT_DIR, HALF_PRECISIONS
from .options import GivenPath, InputError, user_errors


@click.command()
@click.option("--in", "in_dir", type=GivenPath(file_okay=False, path_type=Path), default=DEFAULT_INPUT_DIR,
              show_default=True, help="Input case (attnstep generate; dO for the gradients).")
@click.option("--out", "out_dir", type=GivenPath(file_okay=False, path_type=Path), required=True,
              help="Folder for the stage files (one <stage>.npy each).")
@click.option("--backend", type=click.Choice(tuple(BACKENDS) + (FLEX,)), required=True,
              help="The SDPA backend to force (math-half: the math backend with fp16/bf16 reductions), "
                   "or flex: FlexAttention, compiled.")
@click.option("--precision", type=click.Choice(FLEX_PRECISIONS), default=HALF_PRECISIONS[0], show_default=True,
              help="The format it computes in (fp32: flex only).")
@click.option("--mask", type=click.Choice(MASKS), default=NATIVE, show_default=True,
              help="SDPA, a case whose only mask is causal: the backend's own causal flag, or the mask as an "
                   "attn_mask.")
@click.option("--scale", type=float, default=None,
              help="Scale it uses instead of the case's (to see that a wrong scale fails the check).")
@click.option("--device", type=click.Choice(DEVICES), default=DEVICES[0], show_default=True,
              help="Where torch runs it: the GPU, or torch's CPU kernels (SDPA's math and flash backends, Flex "
                   "uncompiled).")
@user_errors
def main(in_dir: Path, out_dir: Path, backend: str, precision: str, mask: str, scale: Optional[float],
         device: str) -> None:
    """Run PyTorch SDPA or FlexAttention on the case IN and write its results into OUT.

    Check them with `attnstep check --in IN --out OUT --precision PRECISION`. Exit status 1
    when BACKEND cannot run here or cannot compute the case's variant (the reason is printed).
    """
    if backend != FLEX and precision not in HALF_PRECISIONS:
        raise InputError(f"--precision {precision}: SDPA's backends run here at {' or '.join(HALF_PRECISIONS)}; "
                         f"{precision} with --backend {FLEX}")
    try:
        if backend == FLEX:
            results = write_flex_case(in_dir, out_dir, precision, scale, device=device)
        else:
            results = write_sdpa_case(in_dir, out_dir, backend, precision, mask, scale, device=device)
    except BackendUnavailable as exc:
        raise InputError(f"{'FlexAttention' if backend == FLEX else 'SDPA backend'} unavailable: {exc}", 1) from None
    for note in results.notes:
        click.echo(f"note: {note}", err=True)
    fused = backend == FLEX or BACKENDS[backend].fused
    click.echo(f"{'FlexAttention' if backend == FLEX else 'SDPA ' + backend} {precision}: wrote "
               f"{', '.join(stage_arrays(results, fused))} to {out_dir}")


if __name__ == "__main__":
    main()
