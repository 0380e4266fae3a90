"""The engine's side of the diagnoses: a Diagnosis (what explains a failing stage × head, kept in its
HeadResult), a Suspect (what the engine offers the diagnoses of one), and a Diagnoser (the function
from the one to the others).

The diagnoses themselves (verify/diagnose/) build their candidates with this package's references
and bounds, so they sit above it: the layer above both (the command line, the Python API) hands
the engine verify.diagnose.hypotheses.diagnose as its Diagnoser. Without one, a failing stage keeps
the engine's own findings (its invariants' violations, a missing or unreadable file, a run.toml
that disagrees with the input case).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..sequences import Sequences
from ..specs.base import HeadContext
from ..stages import Dims
from ..variant import Variant


# The key loops' bugs (verify/diagnose/softmax_loops.py, key_tiles.py), found by a search over tile widths: a
# decode step's last keys left out (a length one short, new keys unseen) may also fit a width whose
# tiles end there, so the readings of a paged or packed case's keys are still tried where only
# these were named (verify/check/paged.py).
TILE_KEYS_SKIPPED, ONLINE_RESCALE_MISSING = "tile_keys_skipped", "online_rescale_missing"
KEY_TILE_SKIPPED = "key_tile_skipped"
SEARCHED_CODES = (TILE_KEYS_SKIPPED, ONLINE_RESCALE_MISSING, KEY_TILE_SKIPPED)
# A softmax's output not divided by its row sum (verify/diagnose/softmax_loops.py; a split's own, in
# verify/diagnose/splits.py).
SOFTMAX_UNNORMALIZED = "softmax_unnormalized"
# An lse that is the row's (or the splits') largest term alone, log of the sum left out (the same
# modules, and a flash backward's P: verify/diagnose/backward_operands.py).
LSE_SUM_MISSING = "lse_sum_missing"


@dataclass
class Diagnosis:
    code: str
    message: str
    detail: dict = field(default_factory=dict)
    confidence: float = field(default=0.5, repr=False, compare=False)


def precision_convention(d: Diagnosis) -> bool:
    """A diagnosis that the stage passes under another precision or rounding convention (its detail
    names the precision: verify/diagnose/precision.py, score_rounding.py). Where a half-precision
    head fails by a little, a wrong reading of the data may fit such a convention too: it neither
    stops a search of the readings nor outlives a reading that explains the whole sequence."""
    return "precision" in d.detail


def equivalent(d: Diagnosis) -> bool:
    """A causal mask shifted by a few keys (not to the other alignment, a cause of its own), which
    shows or hides a sequence's keys at its ends as a packed or cached reading does: both are named."""
    return d.code == "mask_offset" and not d.detail.get("alignment")


@dataclass
class Packing:
    """The packed case a failing sequence belongs to (its stages are checked as a dense case of
    their own): the packing, the sequence, and a query head's whole packed inputs (Q, K, V, and dO
    where the case has it, every token, float64 as the engine reads them) from which the
    diagnoses recompute what a program that read another sequence's rows wrote. `cache` is
    shared by the sequences of one job (a candidate over the whole stream serves all of them, and
    a head's packed inputs every reading of every sequence: inputs())."""
    sequences: Sequences
    sequence: int
    inputs_of_head: Callable[[int], Dict[str, np.ndarray]]
    cache: dict = field(default_factory=dict)
    # (stage, query head) -> the program's whole packed matrix of that stage (None: not written):
    # a flash backward that misread the packing starts from its own forward's output and lse.
    outputs_of_head: Optional[Callable[[str, int], Optional[np.ndarray]]] = None

    def inputs(self, head: int) -> Dict[str, np.ndarray]:
        """inputs_of_head(head), converted once per job (held in the shared cache)."""
        key = ("inputs", head)
        if key not in self.cache:
            self.cache[key] = self.inputs_of_head(head)
        return self.cache[key]


@dataclass
class Suspect:
    """What the hypotheses see of a failing stage × head besides got and want: the problem, the
    isolated reference's sources and allowance, the other heads' references (head_permuted), the
    run's flash tiles (tile_boundary), and the head's whole context (the backward's bugs rebuild
    a stage from the program's own upstream files), and another head's inputs (keys read past the
    end of a head are the next head's). For a stage of a grouped case's K/V heads summed over its
    query heads (dK, dV and their flash twins), head is the K/V head, head_ctx None (no one query
    head's context holds it), and group_terms each query head's part of the isolated reference,
    in order of head: what a program that summed some of them, or one twice, wrote. slope_of_head:
    any query head's ALiBi slope (a program that took another head's); variant: the case's, where
    there is no head context to hold it (a K/V head's sums); packing: in a packed case, the
    sequence the stage is of and the packed inputs around it; splits: in a run that splits the
    keys, the splits of a failing split stage or combine."""
    dims: Optional[Dims] = None
    scale: float = 1.0
    causal: bool = False
    head: Optional[int] = None
    src: Dict[str, np.ndarray] = field(default_factory=dict)
    ref_of_head: Optional[Callable[[int], np.ndarray]] = None
    flash_tiles: Optional[Tuple[int, int]] = None
    bound: Optional[np.ndarray] = None
    head_ctx: Optional[HeadContext] = None
    inputs_of_head: Optional[Callable[[int], Dict[str, np.ndarray]]] = None
    group_terms: Optional[List[np.ndarray]] = None
    slope_of_head: Optional[Callable[[int], float]] = None
    variant: Optional[Variant] = None
    packing: Optional[Packing] = None
    # A run that splits the keys: a split stage's failure, or a flash stage's against the combine of
    # the program's splits (verify/check/splits.py SplitSuspect); the split diagnoses alone explain it.
    splits: Optional[object] = None
    # A head too long to recompute whole (verify/check/slab.py): the diagnoses find the whole stage's
    # patterns, and slab() gives the causes a slab of its rows, checked as a case of their own, showed.
    slab: Optional[Callable[[], List[Diagnosis]]] = None
    # Within a slab's check: (its first row, the whole head's N and M), by which an alignment is named.
    rows_of_head: Optional[Tuple[int, int, int]] = None


# (stage, got, the isolated reference, the Suspect) -> every pattern that explains got, most
# confident first.
Diagnoser = Callable[[str, np.ndarray, np.ndarray, Suspect], List[Diagnosis]]
