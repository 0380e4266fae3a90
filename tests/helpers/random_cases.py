"""The false-alarm sweep's random cases: shapes from the whole generator space (batch, heads; seq_q
and seq_k from 1 to a few hundred; d_k = d_v at each flash width, odd and unequal head dims),
causal or not, every distribution and file format, sometimes an explicit scale, about a third with
the output gradient dO. Case i's generator is seeded by i.

draw_variant_case(i) lays an attention variant over case i (verify/variant.py): grouped K/V heads
(MQA included), either alignment, windows (narrow ones, ones that leave rows with no key),
softcap (small caps that saturate, 30-50), ALiBi (standard or random slopes), mask files
(document, prefix-LM, random, with empty rows), bias files, dropout, and several at once. Its draws
come from a stream of their own, so the textbook parameters of case i stay the sweep's before
variants; a case prints the `attnstep generate` command that writes it again.

A share of the variant cases without mask or bias files or dropout is packed (verify/sequences.py):
1 .. MAX_SEQUENCES sequences of the case's heads and head dims, sequences without queries or keys
and KV-cache padding (seqused_k) included, drawn from a stream of its own. A share of the forward
ones is a paged KV cache instead (docs/contract.md, "Paged KV caches"): pages of 16 .. 256 keys
and odd small ones, decode steps of a few queries, last pages partial or whole, as `attnstep
generate --page-size` writes it, from a stream of its own too. (tests/helpers/split_runs.py draws
the split-KV runs of the binary from the same cases.)"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import List, Optional

import numpy as np

from verify.files.generate import DISTRIBUTIONS, SPARE_PAGES, paged_case
from verify.files.patterns import MASK_PATTERNS, PREFIX_LM, RANDOM, SLOPE_CHOICES, VariantInputs
from verify.sequences import Sequences, sequences_from_lengths
from verify.stages import FLASH_HEAD_DIMS, FORMATS, MAX_HEAD_DIM, Dims
from verify.variant import ALIGNMENTS, TENSOR_COVERAGE, UNBOUNDED, Variant

SWEEP_SEED = 20260311
MAX_SEQ = 300     # rows/keys: tail tiles of every tile size, yet milliseconds per case
MAX_MACS = 2_000_000  # batch·heads·seq_q·seq_k·(d_k + d_v): keeps a case near 0.3 s on the CPU
BACKWARD_SHARE = 1 / 3  # of the cases have dO


@dataclass(frozen=True)
class Case:
    index: int
    dims: Dims
    causal: bool
    distribution: str
    fmt: str
    scale: Optional[float]  # None: the default 1/√d_k
    backward: bool          # the case has dO

    def __str__(self) -> str:
        d = self.dims
        return (f"case {self.index}: batch={d.batch} heads={d.heads} seq_q={d.seq_q} seq_k={d.seq_k} "
                f"d_k={d.d_k} d_v={d.d_v} causal={self.causal} dist={self.distribution} "
                f"format={self.fmt} scale={self.scale!r} backward={self.backward} seed={self.index}")


def _seq_len(rng: np.random.Generator) -> int:
    """1 (a single row/key), a small length, or one up to MAX_SEQ; never rounded to a tile."""
    kind = rng.integers(4)
    if kind == 0:
        return 1
    return int(rng.integers(2, 20 if kind == 1 else MAX_SEQ + 1))


def _head_dims(rng: np.random.Generator):
    """d_k = d_v at a flash width (the flash stages run), equal but odd, or unequal."""
    kind = rng.integers(4)
    if kind <= 1:
        d = int(rng.choice(FLASH_HEAD_DIMS))
        return d, d
    d_k = int(rng.integers(1, MAX_HEAD_DIM + 1))
    return d_k, (d_k if kind == 2 else int(rng.integers(1, MAX_HEAD_DIM + 1)))


def _scale(rng: np.random.Generator) -> Optional[float]:
    """Mostly the default; sometimes an explicit scale over four decades, now and then negative."""
    if rng.random() < 0.7:
        return None
    return float(np.float32(10.0 ** rng.uniform(-2.5, 0.5) * (-1 if rng.random() < 0.1 else 1)))


def _fit(dims: Dims) -> Dims:
    """`dims` with the longer sequence halved (+1: odd) until the case is within MAX_MACS."""
    d = dims
    while d.batch * d.heads * d.seq_q * d.seq_k * (d.d_k + d.d_v) > MAX_MACS:
        if d.seq_q >= d.seq_k:
            d = replace(d, seq_q=max(1, d.seq_q // 2 + 1))
        else:
            d = replace(d, seq_k=max(1, d.seq_k // 2 + 1))
    return d


def draw_case(index: int) -> Case:
    """Case `index` of the sweep: the same for every case count and backend."""
    rng = np.random.default_rng([SWEEP_SEED, index])
    d_k, d_v = _head_dims(rng)
    batch, heads = int(rng.integers(1, 3)), int(rng.integers(1, 4))
    seq_q, seq_k = _seq_len(rng), _seq_len(rng)
    dims = _fit(Dims(batch, heads, seq_q, seq_k, d_k, d_v))
    causal = bool(rng.integers(2))
    dist, fmt, scale = str(rng.choice(list(DISTRIBUTIONS))), str(rng.choice(FORMATS)), _scale(rng)
    # Drawn last: the forward parameters of case i are those of the sweep before it had dO.
    return Case(index, dims, causal, dist, fmt, scale, bool(rng.random() < BACKWARD_SHARE))


# ---- the variants ----------------------------------------------------------------------------------

VARIANT_STREAM = 1        # the variant's draws: a stream of their own beside the textbook case's
PLAIN_SHARE = 1 / 5       # of the variant cases stay textbook attention (the sweep before variants)
# How often each feature is drawn in the other cases (at least one of them in each).
FEATURE_SHARE = {"gqa": 0.4, "window": 0.4, "softcap": 0.3, "alibi": 0.3, "mask": 0.3, "bias": 0.25,
                 "dropout": 0.3}
MAX_GROUP = 4             # query heads per K/V head of a grouped case
MAX_KV_HEADS = 3
NARROW = 4                # a narrow window side: 0 .. NARROW - 1 keys
SATURATING_CAP = (1.0, 5.0)   # softcaps that |scale·QK| of the wider distributions far exceeds
MODEL_CAP = (30.0, 50.0)      # the caps models ship (Gemma-2: 50 on attention, 30 on the logits)
DROPOUT_P = (0.05, 0.9)
MAX_DROPOUT_SEED = 2 ** 31 - 1


@dataclass(frozen=True)
class VariantCase(Case):
    """A case of the sweep with its variant: `dims` with kv_heads, `variant` (causal: the case's
    flag) and the generator's mask, bias and slopes inputs."""
    variant: Variant = Variant()
    inputs: VariantInputs = field(default_factory=VariantInputs)
    sequences: Optional[Sequences] = None  # a packed case's packing (dims: batch 1, the totals)

    @property
    def per_element_inputs(self) -> bool:
        """Mask or bias files or dropout: the inputs only the CUDA backend's clean flash kernel takes."""
        return bool(self.inputs.mask or self.inputs.bias) or self.variant.dropout > 0

    def generate_args(self) -> dict:
        """The keyword arguments of verify.files.generate.generate_case that write the case beside
        its dims (the causal flag is the variant's)."""
        return dict(seed=self.index, distribution=self.distribution, fmt=self.fmt,
                    scale=self.scale, backward=self.backward, variant=self.variant, inputs=self.inputs,
                    sequences=self.sequences)

    def generate_command(self) -> List[str]:
        """`attnstep generate` options that write the same case (docs/cli.md), for replaying it."""
        d, v, x = self.dims, self.variant, self.inputs
        args = ["--batch", d.batch, "--heads", d.heads, "--seq-q", d.seq_q, "--seq-k", d.seq_k, "--d-k", d.d_k,
                "--d-v", d.d_v, "--dist", self.distribution, "--format", self.fmt, "--seed", self.index]
        args += ["--kv-heads", d.kv_heads] if d.kv_heads else []
        args += ["--scale", repr(self.scale)] if self.scale is not None else []
        args += ["--backward"] if self.backward else []
        args += ["--causal", v.align] if v.causal else ["--align", v.align]
        args += ["--window", f"{v.window[0]},{v.window[1]}"] if v.window != (UNBOUNDED, UNBOUNDED) else []
        args += ["--softcap", repr(v.softcap)] if v.softcap else []
        args += ["--alibi", "--alibi-slopes", x.slopes] if v.alibi else []
        if x.mask:
            args += ["--mask", x.mask, "--mask-heads", x.mask_heads] + (["--mask-empty-rows"] if x.empty_rows else [])
        args += ["--bias", x.bias, "--bias-heads", x.bias_heads] if x.bias else []
        args += ["--dropout", repr(v.dropout), "--dropout-seed", v.dropout_seed] if v.dropout else []
        return [str(a) for a in args + self._sequence_options()]

    def _sequence_options(self) -> list:
        """The packing's options: the lengths, and the used keys or the page size."""
        seqs = self.sequences
        if seqs is None:
            return []
        listed = lambda f: ",".join(str(f(b)) for b in range(seqs.count))  # noqa: E731
        if seqs.paged:  # each sequence reads all its keys (--seqlens-k), from pages of one pool
            return ["--seqlens", listed(seqs.n), "--seqlens-k", listed(seqs.m), "--page-size", seqs.page_size]
        args = ["--seqlens", listed(seqs.n), "--seqlens-k", listed(lambda b: len(seqs.k_slot(b)))]
        return args + (["--seqused-k", ",".join(map(str, seqs.used_k))] if seqs.used_k is not None else [])

    def __str__(self) -> str:
        return f"case {self.index}: attnstep generate --out IN {' '.join(self.generate_command())}"


def _kv_heads(rng: np.random.Generator, dims: Dims) -> Dims:
    """Grouped K/V heads: Hk K/V heads (1: MQA) of groups of 1 .. MAX_GROUP query heads (a group
    of 1: kv_heads = heads, said explicitly); the sequences shortened to keep the case's size."""
    kv = int(rng.integers(1, MAX_KV_HEADS + 1))
    heads = kv * int(rng.integers(1, MAX_GROUP + 1))
    return _fit(replace(dims, heads=heads, kv_heads=kv))


def _window_side(rng: np.random.Generator, dims: Dims) -> int:
    """A narrow side, one up to the longer sequence, or unbounded."""
    kind = rng.integers(5)
    if kind <= 1:
        return int(rng.integers(0, NARROW))
    return int(rng.integers(0, max(dims.seq_q, dims.seq_k) + 1)) if kind <= 3 else UNBOUNDED


def _window(rng: np.random.Generator, dims: Dims, causal: bool):
    """(left, right): causal keeps right 0 or unbounded; never both sides unbounded."""
    left = _window_side(rng, dims)
    right = int(rng.choice([0, UNBOUNDED])) if causal else _window_side(rng, dims)
    if (left, right) == (UNBOUNDED, UNBOUNDED) or (causal and left == UNBOUNDED):
        left = int(rng.integers(0, NARROW))
    return left, right


def _uniform(rng: np.random.Generator, bounds) -> float:
    """A value of `bounds` with two decimals (as a user types it: rarely a float32 exactly)."""
    return round(float(rng.uniform(*bounds)), 2)


def _mask_inputs(rng: np.random.Generator, causal: bool) -> dict:
    """A mask pattern (prefix-LM only without causal: it is causal by itself), random ones with
    empty rows half the time, per head or broadcast."""
    patterns = [p for p in MASK_PATTERNS if not (causal and p == PREFIX_LM)]
    pattern = str(rng.choice(patterns))
    return dict(mask=pattern, mask_heads=str(rng.choice(TENSOR_COVERAGE)),
                empty_rows=pattern == RANDOM and bool(rng.integers(2)))


PACKED_STREAM = 2         # the packing's draws: a stream of their own
PACKED_SHARE = 0.2        # of the variant cases that can be packed (no mask, bias or dropout) are
MAX_SEQUENCES = 5
EMPTY_SHARE = 0.15        # of a packed case's sequences have no queries, or no keys
USED_K_SHARE = 0.3        # of the packed cases have seqused_k (a KV cache's padded slots)


def _lengths(rng: np.random.Generator, count: int, total: int, most: Optional[int] = None) -> List[int]:
    """`count` lengths sharing out about `total` rows (each at most `most` when given), some 0, at
    least one row in all."""
    top = max(2, total // count) if most is None else most
    out = [0 if rng.random() < EMPTY_SHARE else int(rng.integers(1, top + 1)) for _ in range(count)]
    out[-1] = max(out[-1], 1 if sum(out) == 0 else 0)
    return out


def packing(rng: np.random.Generator, dims: Dims) -> Sequences:
    """A packing of about the query and key rows of `dims` (so the case's size stays the sweep's):
    1 .. MAX_SEQUENCES sequences, some empty, some key slots padded (seqused_k)."""
    count = int(rng.integers(1, MAX_SEQUENCES + 1))
    n, slots = _lengths(rng, count, dims.seq_q), _lengths(rng, count, dims.seq_k)
    used = [int(rng.integers(0, s + 1)) for s in slots] if rng.random() < USED_K_SHARE else None
    return sequences_from_lengths(n, slots, used)


def _packing(index: int, case: "VariantCase") -> Optional[Sequences]:
    """The packing of case `index` (None: dense)."""
    rng = np.random.default_rng([SWEEP_SEED, index, PACKED_STREAM])
    if case.per_element_inputs or rng.random() >= PACKED_SHARE:
        return None
    return packing(rng, case.dims)


# ---- paged KV caches -----------------------------------------------------------------------------
# A paged case is written as `attnstep generate --seqlens N --seqlens-k M --page-size P --seed S`
# writes it (verify.files.generate.paged_case): each sequence reads all its keys (no seqused_k of
# its own), its pages dealt from a shuffled pool with spare pages, its table row padded with -1
# past its pages. Forward only, no mask or bias files or dropout (docs/contract.md).

PAGED_STREAM = 3          # the paging's draws: a stream of their own
PAGED_SHARE = 0.5         # of the forward variant cases that can be packed are paged
PAGE_SIZES = (16, 32, 64, 128, 256)  # vLLM's 16 .. flash-attn's 256
ODD_PAGE_SHARE = 0.2      # of the paged cases have pages of 1 .. 15 keys (any size the contract takes)
DECODE_SHARE = 0.5        # of the paged cases are decode steps: 1 .. DECODE_QUERIES queries a sequence
DECODE_QUERIES = 8
DECODE_PAGES = 4          # a decode step's caches: up to this many pages a sequence
WHOLE_PAGES_SHARE = 0.25  # of a paged case's sequences end on a page's end (no partial last page)
POOL_VALUES = 500_000     # pool rows x (d_k + d_v) x K/V heads: the pool's files stay a few MB


def _pool_rows(keys: List[int], page: int) -> int:
    return (sum(-(-m // page) for m in keys) + SPARE_PAGES) * page


def paging(rng: np.random.Generator, dims: Dims, seed: int, longest: Optional[int] = None) -> Sequences:
    """A paged KV cache of `dims`'s heads and widths: 1 .. MAX_SEQUENCES sequences, pages of 16 ..
    256 keys or odd small ones, a decode step's few queries against caches of up to DECODE_PAGES
    pages, or about the rows of `dims`; some sequences without queries or keys, last pages partial
    or whole, each at most `longest` keys when given; the pages dealt from `seed` as `attnstep
    generate --seed` deals them."""
    count = int(rng.integers(1, MAX_SEQUENCES + 1))
    page = int(rng.integers(1, 16)) if rng.random() < ODD_PAGE_SHARE else int(rng.choice(PAGE_SIZES))
    width = (dims.d_k + dims.d_v) * (dims.kv_heads or dims.heads)
    while page > 1 and (count + SPARE_PAGES) * page * width > POOL_VALUES:
        page //= 2
    decode = rng.random() < DECODE_SHARE
    n = _lengths(rng, count, dims.seq_q, DECODE_QUERIES if decode else None)
    keys = max(dims.seq_k, int(rng.integers(1, DECODE_PAGES + 1)) * page * count) if decode else dims.seq_k
    m = [k if longest is None else min(k, longest) for k in _lengths(rng, count, keys)]
    while _pool_rows(m, page) * width > POOL_VALUES and max(m) > 1:
        m = [k // 2 for k in m]
    m[-1] = max(m[-1], 1 if sum(m) == 0 else 0)
    m = [k // page * page if k >= page and rng.random() < WHOLE_PAGES_SHARE else k for k in m]
    while sum(a * b for a, b in zip(n, m)) * dims.heads * (dims.d_k + dims.d_v) > MAX_MACS and max(n) > 1:
        n = [max(1, a // 2) if a else 0 for a in n]  # the cache stays: fewer queries
    return paged_case(n, m, page, seed)


def _paging(index: int, case: "VariantCase") -> Optional[Sequences]:
    """The paging of case `index` (None: not paged): a share of the forward cases that can be packed."""
    rng = np.random.default_rng([SWEEP_SEED, index, PAGED_STREAM])
    if case.per_element_inputs or case.backward or rng.random() >= PAGED_SHARE:
        return None
    return paging(rng, case.dims, index)


def with_sequences(case: "VariantCase", seqs: Optional[Sequences]) -> "VariantCase":
    """`case` packed or paged as `seqs` says (None: as it is): batch 1, the totals as its rows."""
    if seqs is None:
        return case
    return replace(case, dims=replace(case.dims, batch=1, seq_q=seqs.total_q, seq_k=seqs.total_k), sequences=seqs)


def draw_variant_case(index: int) -> VariantCase:
    """Case `index` of the sweep (draw_case) with a variant drawn over it and, for a share of
    those without per-element inputs, paged (forward ones) or packed: the same for every case
    count and backend."""
    case = draw_dense_variant_case(index)
    seqs = _paging(index, case)
    return with_sequences(case, seqs if seqs is not None else _packing(index, case))


def draw_dense_variant_case(index: int) -> VariantCase:
    """Case `index` of the sweep (draw_case) with a variant drawn over it: the same for every case
    count and backend."""
    case = draw_case(index)
    rng = np.random.default_rng([SWEEP_SEED, index, VARIANT_STREAM])
    dims, fields, inputs = case.dims, dict(causal=case.causal), {}
    if rng.random() < PLAIN_SHARE:
        return VariantCase(**vars(case), variant=Variant(**fields))
    drawn = {name for name, share in FEATURE_SHARE.items() if rng.random() < share}
    drawn = drawn or {str(rng.choice(list(FEATURE_SHARE)))}
    fields["align"] = str(rng.choice(ALIGNMENTS))  # the causal mask's, the window's and ALiBi's diagonal
    if "gqa" in drawn:
        dims = _kv_heads(rng, dims)
    if "window" in drawn:
        fields["window"] = _window(rng, dims, case.causal)
    if "softcap" in drawn:
        fields["softcap"] = _uniform(rng, SATURATING_CAP if rng.integers(2) else MODEL_CAP)
    if "alibi" in drawn:
        fields["alibi"] = True
        inputs["slopes"] = str(rng.choice(SLOPE_CHOICES))
    if "mask" in drawn:
        inputs.update(_mask_inputs(rng, case.causal))
    if "bias" in drawn:
        inputs.update(bias=RANDOM, bias_heads=str(rng.choice(TENSOR_COVERAGE)))
    if "dropout" in drawn:
        fields.update(dropout=_uniform(rng, DROPOUT_P), dropout_seed=int(rng.integers(MAX_DROPOUT_SEED)))
    return VariantCase(**{**vars(case), "dims": dims}, variant=Variant(**fields), inputs=VariantInputs(**inputs))


def failures(report) -> list:
    """What failed in a check report: (stage, head, status, the worst error's ratio to its bound,
    its (row, col), the invariants violated) of each stage × head, and (stage, code, message) of
    each run-level check (dropout's keep rate) that failed."""
    found = []
    for r in report.results:
        if not r.passed:
            main = r.main
            where = (r.head,) if r.sequence is None else (r.head, f"sequence {r.sequence}")
            found.append((r.stage, *where, r.status, main.tol_used if main else None,
                          main.worst if main else None, [v.code for v in r.violations]))
    return found + [(c.stage, c.code, c.message) for c in report.run_checks if not c.passed]
