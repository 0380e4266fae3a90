"""`attnstep generate`: a random input case."""
from __future__ import annotations

from pathlib import Path

import click

from ..files.generate import DISTRIBUTIONS, generate_case
from ..files.kinds import CaseError
from ..files.patterns import BIAS_PATTERNS, MASK_PATTERNS, SLOPE_CHOICES, STANDARD_SLOPES, VariantInputs
from ..stages import CASE_INPUTS, DEFAULT_INPUT_DIR, FORMATS, INPUT_NAMES, STAGES, Dims
from ..terminal import progress_bar
from ..text import plural
from ..variant import BROADCAST, TENSOR_COVERAGE, Variant
from .options import (align_option, alibi_option, causal_option, dims_options, dropout_option, dropout_seed_option,
                      force_option, no_causal_option, said_variant, seed_option, softcap_option, user_errors,
                      window_option)

# Values written above which `generate` shows a progress bar (on a terminal only).
GENERATE_PROGRESS_MIN_VALUES = 1 << 22


def variant_options(fn):
    """The variant's options of generate (docs/cli.md), in the order --help lists them."""
    options = (
        click.option("--kv-heads", type=click.IntRange(min=1), metavar="HK",
                     help="K/V heads per batch element (GQA; 1: MQA); must divide --heads [default: --heads]."),
        causal_option, no_causal_option, align_option, window_option, softcap_option, alibi_option,
        click.option("--alibi-slopes", type=click.Choice(SLOPE_CHOICES),
                     help="standard: the geometric slopes (no file); random: write alibi_slopes (B x H) "
                          f"[default: {STANDARD_SLOPES}]."),
        click.option("--mask", "mask", type=click.Choice(tuple(MASK_PATTERNS)), metavar="PATTERN",
                     help="Write mask files: document (block-diagonal documents of random lengths), prefix-lm "
                          "(a random prefix every row sees, causal after), random (each entry kept with "
                          "probability 0.8, a key per row at least)."),
        click.option("--mask-heads", type=click.Choice(TENSOR_COVERAGE),
                     help=f"One mask per query head, or one for all heads [default: {BROADCAST}]."),
        click.option("--mask-empty-rows", is_flag=True,
                     help="With --mask random: some rows see no key (their output is 0, their lse -inf)."),
        click.option("--bias", "bias", type=click.Choice(BIAS_PATTERNS), metavar="PATTERN",
                     help="Write additive bias files: random (normal values, a few -inf)."),
        click.option("--bias-heads", type=click.Choice(TENSOR_COVERAGE),
                     help=f"One bias per query head, or one for all heads [default: {BROADCAST}]."),
        dropout_option, dropout_seed_option,
    )
    for option in reversed(options):
        fn = option(fn)
    return fn


def _variant_inputs(mask, mask_heads, mask_empty_rows, bias, bias_heads, alibi_slopes) -> VariantInputs:
    """What to draw besides Q, K, V; an option that qualifies another one not given is refused."""
    for option, value, needs, given in (("--mask-heads", mask_heads, "--mask", mask),
                                        ("--mask-empty-rows", mask_empty_rows, "--mask random", mask),
                                        ("--bias-heads", bias_heads, "--bias", bias)):
        if value and not given:
            raise CaseError(f"{option} needs {needs}")
    return VariantInputs(mask=mask, mask_heads=mask_heads or BROADCAST, bias=bias, bias_heads=bias_heads or BROADCAST,
                         slopes=alibi_slopes or STANDARD_SLOPES, empty_rows=mask_empty_rows)


def _variant(causal, no_causal, align, window, softcap, alibi, alibi_slopes, dropout, dropout_seed) -> Variant:
    if alibi_slopes and not alibi:
        raise CaseError(f"--alibi-slopes {alibi_slopes} needs --alibi")
    if dropout_seed is not None and not dropout:
        raise CaseError("--dropout-seed needs --dropout P (P > 0)")
    fields = said_variant(causal, no_causal, align, window, softcap, alibi, dropout, dropout_seed)
    try:
        return Variant(**fields)
    except ValueError as exc:  # the options' types hold each value: only causal and the window clash
        raise CaseError(f"--causal with --window: {exc}") from None


@click.command()
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=DEFAULT_INPUT_DIR, show_default=True, help="Input case folder to write.")
@dims_options
@variant_options
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
def generate(out_dir, batch, heads, seq_q, seq_k, d_k, d_v, kv_heads, causal, no_causal, align, window, softcap,
             alibi, alibi_slopes, mask, mask_heads, mask_empty_rows, bias, bias_heads, dropout, dropout_seed, scale,
             seed, distribution, fmt, backward, force):
    """Write a random input case.

    Writes Q_head_{i} for every head i (batch-major) and K_head_{j}, V_head_{j} for every K/V head
    j (with --backward also dO_head_{i}), the mask, bias and slopes files the options ask for, and
    manifest.toml into OUT, replacing the case attnstep generated there before (with --force, any
    input case).
    """
    if kv_heads is not None and (kv_heads > heads or heads % kv_heads):
        raise CaseError(f"--kv-heads {kv_heads} does not divide --heads {heads}: each K/V head serves the same "
                        "number of query heads")
    dims = Dims(batch, heads, seq_q, seq_k, d_k, d_v, kv_heads=0 if kv_heads in (None, heads) else kv_heads)
    variant = _variant(causal, no_causal, align, window, softcap, alibi, alibi_slopes, dropout, dropout_seed)
    inputs = _variant_inputs(mask, mask_heads, mask_empty_rows, bias, bias_heads, alibi_slopes)
    names = CASE_INPUTS if backward else INPUT_NAMES
    values = sum(dims.heads_of(n) * r * c for n, (r, c) in ((n, STAGES[n].shape(dims)) for n in names))
    with progress_bar(dims.total_heads, "generating heads", values >= GENERATE_PROGRESS_MIN_VALUES) as advance:
        generate_case(out_dir, dims, scale=scale, seed=seed, distribution=distribution, fmt=fmt, backward=backward,
                      force=force, progress=advance, variant=variant, inputs=inputs)
    kv = f", {plural(dims.kv, 'K/V head')} per batch element" if dims.kv_heads else ""
    click.echo(f"wrote {plural(dims.total_heads, 'head')} (N={seq_q} M={seq_k} d_k={d_k} d_v={d_v}{kv}, "
               f"{distribution}, seed {seed}) to {out_dir}")
