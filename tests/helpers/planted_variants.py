"""The planted bugs of the variants' cross-checks (tests/test_gpu_cross_checks.py with PyTorch's
SDPA and FlexAttention on a GPU, tests/test_sdpa_cases.py with their NumPy stand-ins): what each bug
changes in a case's tensors before the program runs, where it must first show, and the verifier's
name for it.

The bugs: the other causal alignment; a window one key wider on the left; the softcap left out
(Flex only: SDPA has none); ALiBi's slopes in reverse head order; dK of each group's first query
head instead of the group's sum (the program runs without grouping, one_head_dk then keeps that
query head's dK).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

from verify.bench.foreign_outputs import CaseTensors
from verify.model.half import round_to_format32
from verify.stages import (FLASH_GRAD_KEYS, FLASH_GRAD_VALUES, FLASH_OUTPUT, GRAD_KEYS, GRAD_VALUES, KEYS, OUTPUT,
                           QUERIES, VALUES, Dims)
from verify.variant import BOTTOM_RIGHT, TOP_LEFT

OTHER_ALIGNMENT, WINDOW_OFF_BY_ONE, SOFTCAP_LEFT_OUT, ALIBI_REVERSED, DK_ONE_HEAD = (
    "other-alignment", "window-off-by-one", "softcap-left-out", "alibi-reversed", "dk-one-head")
SDPA_CANNOT = {SOFTCAP_LEFT_OUT}  # SDPA has no softcap to leave out


def ungrouped(t: CaseTensors) -> CaseTensors:
    """K and V repeated for every query head: a program that shares no K/V head (its dK and dV
    then come per query head; one_head_dk gives them the case's K/V heads again)."""
    group = t.inputs[QUERIES].shape[1] // t.inputs[KEYS].shape[1]
    return t.with_(inputs={**t.inputs, **{n: np.repeat(t.inputs[n], group, axis=1) for n in (KEYS, VALUES)}})


def _other_alignment(t: CaseTensors) -> CaseTensors:
    return t.with_(variant=t.variant.with_(align=TOP_LEFT if t.variant.align == BOTTOM_RIGHT else BOTTOM_RIGHT))


def _wider_window(t: CaseTensors) -> CaseTensors:
    left, right = t.variant.window
    return t.with_(variant=t.variant.with_(window=(left + 1, right)))


PLANTS: Dict[str, Callable[[CaseTensors], CaseTensors]] = {
    OTHER_ALIGNMENT: _other_alignment,
    WINDOW_OFF_BY_ONE: _wider_window,
    SOFTCAP_LEFT_OUT: lambda t: t.with_(variant=t.variant.with_(softcap=0.0)),
    ALIBI_REVERSED: lambda t: t.with_(slopes=t.slopes[:, ::-1].copy()),
    DK_ONE_HEAD: ungrouped,
}

# The verifier's name for each planted bug (the report's `diagnosis` code). A bug's name is
# asserted once the bug is in NAMED (the variants' diagnoses are being added; until its name
# exists the tests assert the failure and its stage): the one list to update.
DIAGNOSES = {OTHER_ALIGNMENT: "mask_alignment", WINDOW_OFF_BY_ONE: "window_offset",
             SOFTCAP_LEFT_OUT: "softcap_missing", ALIBI_REVERSED: "alibi_head_order",
             DK_ONE_HEAD: "kv_group_not_summed"}
NAMED: frozenset = frozenset()
assert NAMED <= set(PLANTS) and set(DIAGNOSES) == set(PLANTS)


def one_head_dk(out_dir: Path, dims: Dims, precision: str) -> str:
    """dK of each group's first query head instead of the group's sum (the planted bug), dV the
    group's sum in the format (correct), over an ungrouped run's files; returns dK's stage."""
    for dk, dv in ((FLASH_GRAD_KEYS, FLASH_GRAD_VALUES), (GRAD_KEYS, GRAD_VALUES)):
        if (out_dir / f"{dk}.npy").exists():
            x, y = np.load(out_dir / f"{dk}.npy"), np.load(out_dir / f"{dv}.npy")
            np.save(out_dir / f"{dk}.npy", x[:, ::dims.group_size])
            summed = y.astype(np.float32).reshape(dims.batch, dims.kv, dims.group_size, *y.shape[2:]).sum(axis=2)
            np.save(out_dir / f"{dv}.npy", round_to_format32(summed, precision).astype(y.dtype))
            return dk
    raise AssertionError(f"no dK in {out_dir}")


def failures(report) -> List[tuple]:
    """(stage, head, status, diagnosis codes) of each failing result of a JSON report."""
    return [(r["stage"], r["head"], r["status"], [d["code"] for d in r["diagnosis"]])
            for r in report["results"] if not r["passed"]]


def assert_fails_where_it_starts(code: int, report, bug: str, fused: bool, dk_stage: Optional[str] = None) -> None:
    """The check failed; a mask or score bug first at the forward output (the flash stage for a
    fused kernel), the group's sum only at dK; the bug's name there once it is in NAMED."""
    found = failures(report)
    assert code == 1, found
    if dk_stage is None:
        stage = FLASH_OUTPUT if fused else OUTPUT
        assert report["first_failing_stage"] == stage, found
    else:
        stage = dk_stage
        assert {s for s, *_ in found} == {stage}, found
    if bug in NAMED:
        codes = {c for s, _, _, named in found if s == stage for c in named}
        assert DIAGNOSES[bug] in codes, found
