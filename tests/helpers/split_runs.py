"""The false-alarm sweep's split-KV runs of the binary (`main --split-size K`, flash-decoding): case i
is the sweep's variant case i (tests/helpers/random_cases.py draw_dense_variant_case) made one that a
run that splits takes, laid out dense, packed or paged, and a split size K drawn with it:

* the head widths those of the flash stages (the split stages come with the flash forward), and no
  dropout (the split stages have none); mask and bias files stay in a share of the dense cases (the
  CPU backend splits every variant; the CUDA split kernel refuses them in one line);
* dense, packed (verify/sequences.py: sequences without queries or keys, padded slots) or paged
  (pages of 1 .. 256 keys, decode steps; forward only), a third each;
* K of one key, a few keys, a third of the longest sequence's keys, or more than all of them (one
  split); the keys and the queries are cut down until the case has at most MAX_SPLITS splits and
  its split files at most SPLIT_VALUES values, so a case stays a fraction of a second.

Drawn from a stream of its own beside the case's, so case i is the same for every count and
backend; its text is the `attnstep generate` and `attnstep run` options that run it again.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Tuple

import numpy as np

from verify.files.patterns import VariantInputs
from verify.stages import FLASH_HEAD_DIMS

from helpers.end_to_end import run_command
from helpers.random_cases import SWEEP_SEED, VariantCase, draw_dense_variant_case, packing, paging, with_sequences

SPLIT_STREAM = 4          # the split run's draws: a stream of their own beside the case's
LAYOUTS = ("dense", "packed", "paged")
SPLIT_KINDS = ("one key", "a few", "a third", "past every key")
FEW = (2, 9)              # "a few" keys per split: 2 .. 8
MAX_SPLITS = 24           # each split is checked over its keys: a case costs up to S flash checks
SPLIT_VALUES = 400_000    # heads x query rows x splits x (d_v + 1): the split files of a case
PER_ELEMENT_SHARE = 0.3   # of the dense cases drawn with mask or bias files keep them


@dataclass(frozen=True)
class SplitRun:
    """A case of the split sweep: the input case and the keys per split of its run."""
    case: VariantCase
    split_size: int
    kind: str             # which of SPLIT_KINDS the split size is

    @property
    def layout(self) -> str:
        seqs = self.case.sequences
        return "dense" if seqs is None else "paged" if seqs.paged else "packed"

    @property
    def most_keys(self) -> int:
        """The keys of the longest sequence (a dense case: seq_k): the splits S = ceil(most / K)."""
        seqs = self.case.sequences
        return self.case.dims.seq_k if seqs is None else max(seqs.m(b) for b in range(seqs.count))

    @property
    def splits(self) -> int:
        return max(1, -(-self.most_keys // self.split_size))

    def run_options(self) -> List[str]:
        return ["--split-size", str(self.split_size)]

    def describe(self, backend: Tuple[str, Tuple[str, ...]]) -> str:
        """The commands that write the case and run it on `backend` again."""
        return f"{self.case}; {run_command(backend, self.run_options())} ({self.layout}, {self.splits} splits)"


def _split_dims(case: VariantCase, rng: np.random.Generator) -> VariantCase:
    """`case` with the flash stages' head widths (d_k = d_v; the case's own when they are), no
    dropout, and mask or bias files kept in PER_ELEMENT_SHARE of the cases that have them."""
    dims = case.dims
    if not dims.flash_supported:
        width = int(rng.choice(FLASH_HEAD_DIMS))
        dims = replace(dims, d_k=width, d_v=width)
    inputs, variant = case.inputs, replace(case.variant, dropout=0.0, dropout_seed=0)
    if (inputs.mask or inputs.bias) and rng.random() >= PER_ELEMENT_SHARE:
        inputs = VariantInputs(slopes=inputs.slopes)
    return replace(case, dims=dims, variant=variant, inputs=inputs)


def _cut(case: VariantCase, keys: int, splits: int) -> VariantCase:
    """`case` with at most `keys` keys, and few enough queries that its split files hold at most
    SPLIT_VALUES values at `splits` splits."""
    d = case.dims
    queries = max(1, SPLIT_VALUES // (d.batch * d.heads * splits * (d.d_v + 1)))
    return replace(case, dims=replace(d, seq_q=min(d.seq_q, queries), seq_k=max(1, min(d.seq_k, keys))))


def _split_size(kind: str, few: int, most: int, rng: np.random.Generator) -> int:
    if kind == "one key":
        return 1
    if kind == "a few":
        return few
    if kind == "a third":
        return max(1, most // 3)
    return most + int(rng.integers(1, 9))


def draw_split_run(index: int) -> SplitRun:
    """Split run `index`: the same for every case count and backend."""
    rng = np.random.default_rng([SWEEP_SEED, index, SPLIT_STREAM])
    case = _split_dims(draw_dense_variant_case(index), rng)
    kind, few = str(rng.choice(SPLIT_KINDS)), int(rng.integers(*FEW))
    layout = "dense" if case.per_element_inputs else str(rng.choice(LAYOUTS))
    # The longest sequence's keys cut to MAX_SPLITS splits where K is a key or a few; a third makes
    # 3 to 5 splits (K = most // 3, 1 below 6 keys), more than every key one.
    longest = {"one key": MAX_SPLITS, "a few": few * MAX_SPLITS}.get(kind)
    case = _cut(case, longest or case.dims.seq_k, {"a third": 5, "past every key": 1}.get(kind, MAX_SPLITS))
    if layout == "packed":
        case = with_sequences(case, packing(rng, case.dims))
    elif layout == "paged":
        case = with_sequences(replace(case, backward=False), paging(rng, case.dims, index, longest))
    run = SplitRun(case, 1, kind)
    return replace(run, split_size=_split_size(kind, few, run.most_keys, rng))
