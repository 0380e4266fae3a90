"""The paged diagnoses of a checked paged input case (a folder, not arrays): the program's stages
read back in the decode step's layout, and re-checks of each reading through the check engine,
which hands its own entry points in (it calls this module, so this module does not import it).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict

import numpy as np

from ..files.case import InputCase
from ..files.kv_cache import KV_CACHE_STAGES
from ..files.outputs import RunInfo, StageSource
from ..stages import ALIBI_SLOPES_INPUT, KEYS, QUERIES, STAGES, VALUES
from .paged import Recheck, case_cache, diagnose_paged
from .results import Report


def _program_stages(run, load_output: Callable) -> Dict[str, np.ndarray]:
    """The program's output, flash_output and flash_lse over every query head, in the packed step
    layout (total_q, H, d) and (H, total_q); a stage that cannot be read is left out."""
    out = {}
    for stage in (s for s in KV_CACHE_STAGES if s in run.stages):
        mats = [load_output(run, stage, h)[0] for h in range(run.dims.heads)]
        if any(m is None for m in mats):
            continue
        out[stage] = (np.stack([m[:, 0] for m in mats]) if STAGES[stage].cols == "1"
                      else np.stack(mats, axis=1))
    return out


def _case_recheck(run, case, check_run: Callable, options) -> Recheck:
    """Re-checks readings of a paged input case: the gathered keys as a packed case of arrays, with
    the run's variant, scale and arithmetic."""

    def recheck(q, k, v, stages, seqs) -> Report:
        dims = replace(run.dims, batch=1, seq_q=seqs.total_q, seq_k=seqs.total_k)
        arrays = {QUERIES: q.transpose(1, 0, 2), KEYS: k.transpose(1, 0, 2), VALUES: v.transpose(1, 0, 2)}
        if run.variant.alibi:
            arrays[ALIBI_SLOPES_INPUT] = np.array([[case.alibi_slope(h) for h in range(run.dims.heads)]])
        sub_case = InputCase(case.path, dims, "npy", scale=run.scale, manifest=True, arrays=arrays,
                             variant=run.variant, sequences=seqs)
        sources = {s: StageSource(s, None, s, arrays=(x[:, :, None] if STAGES[s].cols == "1"
                                                      else x.transpose(1, 0, 2)))
                   for s, x in stages.items()}
        sub_run = RunInfo(None, {}, dims, sources, scale=run.scale, precision=run.precision, math=run.math,
                          half_rounding=run.half_rounding, variant=run.variant)
        return check_run(sub_run, sub_case, options)
    return recheck


def diagnose_paged_case(report: Report, check_run: Callable, options, load_output: Callable) -> None:
    """The paged diagnoses of a checked paged input case, as check_kvcache searches them: a failing
    sequence's output, flash_output and flash_lse re-checked on the readings a buggy program makes
    of its pages (paged_wrong_page, paged_page_shift, paged_past_length)."""
    if all(r.passed or r.sequence is None for r in report.results):
        return
    stages = _program_stages(report.run, load_output)
    if not stages:
        return
    kv = case_cache(report.case, report.run.dims)
    diagnose_paged(report, kv, stages, _case_recheck(report.run, report.case, check_run, options))
