"""`attnstep generate`: a random input case."""
from __future__ import annotations

from pathlib import Path

import click

from ..files.generate import DISTRIBUTIONS, generate_case
from ..stages import CASE_INPUTS, DEFAULT_INPUT_DIR, FORMATS, INPUT_NAMES, STAGES, Dims
from ..terminal import progress_bar
from ..text import plural
from .options import dims_options, force_option, seed_option, user_errors

# Values written above which `generate` shows a progress bar (on a terminal only).
GENERATE_PROGRESS_MIN_VALUES = 1 << 22


@click.command()
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=DEFAULT_INPUT_DIR, show_default=True, help="Input case folder to write.")
@dims_options
@click.option("--causal/--no-causal", default=False, show_default=True,
              help="Causal (top-left aligned) masking.")
@click.option("--scale", type=float, default=None, help="Score scale [default: 1/sqrt(d_k)].")
@seed_option
@click.option("--dist", "distribution", type=click.Choice(tuple(DISTRIBUTIONS)), default="uniform",
              show_default=True, help="uniform [0,1) as the original; normal; large (logits in the hundreds).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="txt", show_default=True,
              help="Matrix file format.")
@click.option("--backward", is_flag=True,
              help="Also write the output gradient dO_head_{i} (seq_q x d_v), for the backward stages.")
@force_option
@user_errors
def generate(out_dir, batch, heads, seq_q, seq_k, d_k, d_v, causal, scale, seed, distribution, fmt, backward,
             force):
    """Write a random input case.

    Writes Q_head_{i}, K_head_{i}, V_head_{i} (with --backward also dO_head_{i}) for every head i
    (batch-major) and manifest.toml into OUT, replacing the case attnstep generated there before
    (with --force, any input case).
    """
    dims = Dims(batch, heads, seq_q, seq_k, d_k, d_v)
    inputs = CASE_INPUTS if backward else INPUT_NAMES
    values = dims.total_heads * sum(r * c for r, c in (STAGES[n].shape(dims) for n in inputs))
    with progress_bar(dims.total_heads, "generating heads", values >= GENERATE_PROGRESS_MIN_VALUES) as advance:
        generate_case(out_dir, dims, causal=causal, scale=scale, seed=seed, distribution=distribution,
                      fmt=fmt, backward=backward, force=force, progress=advance)
    click.echo(f"wrote {plural(dims.total_heads, 'head')} (N={seq_q} M={seq_k} d_k={d_k} d_v={d_v}, "
               f"{distribution}, seed {seed}) to {out_dir}")
