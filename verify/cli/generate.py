"""`attnstep generate`: a random input case."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import click
from click.core import ParameterSource

from ..files.generate import DISTRIBUTIONS, generate_case, paged_case, random_seqlens
from ..files.kinds import CaseError
from ..files.new_keys import new_keys_for
from ..files.patterns import BIAS_PATTERNS, MASK_PATTERNS, SLOPE_CHOICES, STANDARD_SLOPES, VariantInputs
from ..sequences import (MAX_TOKENS, NEW_KEYS_BACKWARD, PAGED_BACKWARD, Sequences, sequences_from_lengths,
                         unsupported_with_packing)
from ..stages import CASE_INPUTS, DEFAULT_INPUT_DIR, FORMATS, INPUT_NAMES, STAGES, Dims
from ..terminal import progress_bar
from ..text import plural, printable
from ..variant import BROADCAST, TENSOR_COVERAGE, Variant
from .options import (GivenPath, align_option, alibi_option, causal_option, dims_options, dropout_option,
                      dropout_seed_option, force_option, given_text, no_causal_option, said_variant, seed_option,
                      softcap_option, user_errors, window_option)

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


def packing_options(fn):
    """generate's options of a packed case (docs/cli.md), in the order --help lists them."""
    options = (
        click.option("--seqlens", metavar="N1,N2,...", callback=given_text,
                     help="Pack sequences of these query lengths (a packed case: cu_seqlens files, batch 1, "
                          "seq_q their total)."),
        click.option("--seqlens-k", metavar="M1,M2,...", callback=given_text,
                     help="With --seqlens: each sequence's key slot [default: the query lengths]."),
        click.option("--seqused-k", metavar="U1,U2,...", callback=given_text,
                     help="With --seqlens-k: the keys each sequence uses of its slot (a KV cache's fill)."),
        click.option("--random-seqlens", metavar="B,MAX", callback=given_text,
                     help="Pack B sequences of random lengths 1..MAX (from --seed), keys as many as queries."),
        click.option("--page-size", type=click.IntRange(1, MAX_TOKENS), metavar="P",
                     help="With --seqlens or --random-seqlens: a paged KV cache; each sequence's keys (--seqlens-k) "
                          "in pages of P keys of one pool (K, V), dealt in a shuffled order (from --seed), read "
                          "through block_table; seqused_k the key lengths. Forward only."),
        click.option("--new-keys", type=click.IntRange(1, MAX_TOKENS), metavar="N",
                     help="With --seqlens or --random-seqlens: a decode step that appends N new keys and values "
                          "(K_new_head_{j}, V_new_head_{j}) to each sequence's KV cache before attention. Each "
                          "sequence's keys count them: its cache holds N fewer before the step (seqused_k). "
                          "Forward only."),
    )
    for option in reversed(options):
        fn = option(fn)
    return fn


def _lengths(option: str, text: str, at_least: int = 0) -> List[int]:
    """A comma list of whole numbers >= at_least; one line naming the option otherwise."""
    out = []
    for token in text.split(","):
        token = token.strip()
        if not (token.isascii() and token.isdigit()) or int(token) < at_least:
            raise CaseError(f"{option} {text}: {printable(repr(token))} is not a length (a whole number >= {at_least})")
        out.append(int(token))
    return out


def _packing(seqlens, seqlens_k, seqused_k, random, seed, page_size=None, backward=False,
             new_keys=None) -> Optional[Sequences]:
    """The sequences the packing options ask for (None: a case that is not packed); with
    page_size, their paging; with new_keys, the decode step's."""
    seqs = _paging(seqlens, seqlens_k, seqused_k, random, seed, page_size, backward)
    if new_keys is None:
        return seqs
    if seqs is None:
        raise CaseError(f"--new-keys {new_keys} needs --seqlens or --random-seqlens (new keys are appended to each "
                        "sequence's KV cache)")
    if backward:
        raise CaseError(f"--new-keys with --backward: {NEW_KEYS_BACKWARD}")
    try:
        return new_keys_for(seqs, new_keys)
    except ValueError as exc:
        if random:  # (random lengths: the sequence's keys are as many as its queries, drawn from --seed)
            raise CaseError(f"--new-keys {new_keys}: {exc} (--random-seqlens {random}); HINT: give the lengths with "
                            f"--seqlens and --seqlens-k (at least {new_keys} keys each), or a larger MAX or another "
                            "--seed") from None
        said = "--seqused-k" if seqused_k else "--seqlens-k" if seqlens_k else "the keys"
        raise CaseError(f"--new-keys {new_keys}: {exc} ({said}); HINT: give each sequence at least {new_keys} keys") \
            from None


def _paging(seqlens, seqlens_k, seqused_k, random, seed, page_size=None, backward=False) -> Optional[Sequences]:
    """The sequences the packing options ask for (None: a case that is not packed); with
    page_size, their paging."""
    if page_size is not None:
        if not (seqlens or random):
            raise CaseError(f"--page-size {page_size} needs --seqlens or --random-seqlens (a paged case is packed)")
        if seqused_k:
            raise CaseError("--page-size with --seqused-k: a paged case's sequences read all their keys "
                            "(--seqlens-k); HINT: leave --seqused-k out")
        if backward:
            raise CaseError(f"--page-size with --backward: {PAGED_BACKWARD}")
    seqs = _packed(seqlens, seqlens_k, seqused_k, random, seed)
    if seqs is None or page_size is None:
        return seqs
    try:
        return paged_case([seqs.n(b) for b in range(seqs.count)], [seqs.m(b) for b in range(seqs.count)],
                          page_size, seed)
    except ValueError as exc:
        raise CaseError(f"--page-size {page_size}: {exc}") from None


def _packed(seqlens, seqlens_k, seqused_k, random, seed) -> Optional[Sequences]:
    """The sequences the packing options ask for, not paged (None: a case that is not packed)."""
    for option, value, needs, given in (("--seqlens-k", seqlens_k, "--seqlens", seqlens),
                                        ("--seqused-k", seqused_k, "--seqlens-k", seqlens_k)):
        if value and not given:
            raise CaseError(f"{option} needs {needs}")
    if random and seqlens:
        raise CaseError("--random-seqlens and --seqlens: choose one")
    if random:
        parts = _lengths("--random-seqlens", random, 1)
        if len(parts) != 2 or max(parts) > MAX_TOKENS:
            raise CaseError(f"--random-seqlens {random}: expected B,MAX (the number of sequences and the longest "
                            f"length, each 1..{MAX_TOKENS})")
        seqlens_q = random_seqlens(parts[0], parts[1], seed)
        said_q = ("--random-seqlens", random)
    elif seqlens:
        seqlens_q = _lengths("--seqlens", seqlens)
        said_q = ("--seqlens", seqlens)
    else:
        return None
    keys = _lengths("--seqlens-k", seqlens_k) if seqlens_k else None
    if keys is not None and len(keys) != len(seqlens_q):
        raise CaseError(f"--seqlens-k {seqlens_k}: {plural(len(keys), 'length')} for {len(seqlens_q)} sequences "
                        "(--seqlens)")
    # The totals are the case's seq_q and seq_k: said here in the options' words, before they
    # become dimensions (or overflow the offsets' integers).
    said_k = ("--seqlens-k", seqlens_k) if keys is not None else said_q
    for total, what, key, (option, text) in ((sum(seqlens_q), "query", "seq_q", said_q),
                                             (sum(seqlens_q if keys is None else keys), "key", "seq_k", said_k)):
        if total == 0:  # random lengths are 1 at least
            raise CaseError(f"{option} {text}: no {what} in all; a case needs one at least")
        if total > MAX_TOKENS:
            raise CaseError(f"{option} {text}: {total} {what} tokens in all; {key}, their total, is at most "
                            f"{MAX_TOKENS}")
    try:
        return sequences_from_lengths(seqlens_q, keys, _lengths("--seqused-k", seqused_k) if seqused_k else None)
    except ValueError as exc:  # only seqused_k's rules remain to break
        raise CaseError(f"--seqused-k {seqused_k}: {exc}") from None


def _packed_dims(seqs: Sequences, option: str, dims: Dims, variant: Variant, inputs: VariantInputs) -> Dims:
    """The case's dimensions with the packing's totals; what contradicts the packing refused."""
    ctx = click.get_current_context()
    if dims.batch != 1:
        raise CaseError(f"{option} with --batch {dims.batch}: a packed case has batch 1 (its sequences are the batch)")
    for key, flag, total, what in (("seq_q", "--seq-q", seqs.total_q, "queries"), ("seq_k", "--seq-k", seqs.total_k, "keys")):
        given = getattr(dims, key)
        if ctx.get_parameter_source(key) != ParameterSource.DEFAULT and given != total:
            raise CaseError(f"{flag} {given} with {option}: the sequences hold {total} {what} in all; HINT: leave "
                            f"{flag} out (it is the total)")
    problem = unsupported_with_packing(bool(inputs.mask), bool(inputs.bias), variant.dropout > 0)
    if problem:
        flag = "--mask" if inputs.mask else "--bias" if inputs.bias else "--dropout"
        raise CaseError(f"{option} with {flag}: {problem}")
    return Dims(1, dims.heads, seqs.total_q, seqs.total_k, dims.d_k, dims.d_v, dims.kv_heads)


@click.command()
@click.option("--out", "out_dir", type=GivenPath(file_okay=False, path_type=Path),
              default=DEFAULT_INPUT_DIR, show_default=True, help="Input case folder to write.")
@dims_options
@variant_options
@packing_options
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
             alibi, alibi_slopes, mask, mask_heads, mask_empty_rows, bias, bias_heads, dropout, dropout_seed, seqlens,
             seqlens_k, seqused_k, random_seqlens, page_size, new_keys, scale, seed, distribution, fmt, backward,
             force):
    """Write a random input case.

    Writes Q_head_{i} for every head i (batch-major) and K_head_{j}, V_head_{j} for every K/V head
    j (with --backward also dO_head_{i}), the mask, bias and slopes files the options ask for, and
    manifest.toml into OUT, replacing the case attnstep generated there before (with --force, any
    input case). With --seqlens or --random-seqlens the case is packed: its sequences lie one after
    the other along the rows of one batch element, and cu_seqlens_q, cu_seqlens_k (and with
    --seqused-k, seqused_k) say where each begins. With --page-size the keys lie in pages of one
    pool, and block_table (with cu_seqlens_q and seqused_k) says which pages each sequence reads.
    With --new-keys the case is a decode step: K_new_head_{j} and V_new_head_{j} hold the keys and
    values each sequence appends to its cache before attention.
    """
    if kv_heads is not None and (kv_heads > heads or heads % kv_heads):
        raise CaseError(f"--kv-heads {kv_heads} does not divide --heads {heads}: each K/V head serves the same "
                        "number of query heads")
    dims = Dims(batch, heads, seq_q, seq_k, d_k, d_v, kv_heads=0 if kv_heads in (None, heads) else kv_heads)
    variant = _variant(causal, no_causal, align, window, softcap, alibi, alibi_slopes, dropout, dropout_seed)
    inputs = _variant_inputs(mask, mask_heads, mask_empty_rows, bias, bias_heads, alibi_slopes)
    seqs = _packing(seqlens, seqlens_k, seqused_k, random_seqlens, seed, page_size, backward, new_keys)
    if seqs is not None:
        dims = _packed_dims(seqs, "--random-seqlens" if random_seqlens else "--seqlens", dims, variant, inputs)
    names = CASE_INPUTS if backward else INPUT_NAMES
    values = sum(dims.heads_of(n) * r * c for n, (r, c) in ((n, STAGES[n].shape(dims)) for n in names))
    with progress_bar(dims.total_heads, "generating heads", values >= GENERATE_PROGRESS_MIN_VALUES) as advance:
        generate_case(out_dir, dims, scale=scale, seed=seed, distribution=distribution, fmt=fmt, backward=backward,
                      force=force, progress=advance, variant=variant, inputs=inputs, sequences=seqs)
    kv = f", {plural(dims.kv, 'K/V head')} per batch element" if dims.kv_heads else ""
    kv += f", {plural(seqs.count, 'packed sequence')}" if seqs is not None else ""
    kv += f" in {plural(seqs.num_pages, 'page')} of {seqs.page_size}" if seqs is not None and seqs.paged else ""
    kv += f", {plural(seqs.new_keys, 'new key')} each" if seqs is not None and seqs.new_keys else ""
    click.echo(f"wrote {plural(dims.total_heads, 'head')} (N={dims.seq_q} M={dims.seq_k} d_k={d_k} d_v={d_v}{kv}, "
               f"{distribution}, seed {seed}) to {out_dir}")
