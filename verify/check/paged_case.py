"""The decode-step diagnoses of a checked input case (a folder, not arrays): a paged case, or a
packed one with new keys. The program's stages read back in the decode step's layout, and re-checks
of each reading through the check engine, which hands its own entry points in (it calls this
module, so this module does not import it); and the cache after a step with new keys (the K and V
stages) explained by verify/check/new_keys.py.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from ..files.case import InputCase
from ..files.kv_cache import KV_CACHE_STAGES, KVCache
from ..files.new_keys import read_new_keys
from ..sequences import NEW_KEY_INPUTS
from ..files.outputs import RunInfo, StageSource
from ..files.resolution import Resolution
from ..model.half import echoed
from ..stages import ALIBI_SLOPES_INPUT, KEYS, QUERIES, STAGES, VALUES
from .new_keys import CacheLayout, cache_findings, pool_layout, slot_layout
from .paged import Recheck, diagnose_paged
from .results import FAIL, Report


@dataclass
class _PrintedArrays(StageSource):
    """A reading's rows of a program's stage, as arrays that keep the printed resolution of the
    program's files (a `%g` file's rows re-checked as exact float32 would fail every reading)."""
    resolution: Optional[Resolution] = None

    def read(self, head, dims, data=None):
        mat, resolution, raw = super().read(head, dims, data)
        return mat, self.resolution or resolution, raw


def _coarseness(resolution: Resolution) -> float:
    """How far a printed 1 may be from the value the program held (exact: 0)."""
    quantum = resolution.quantum(np.ones(1))
    return 0.0 if quantum is None else float(quantum[0])


def _program_stages(run, load_output: Callable) -> Tuple[Dict[str, np.ndarray], Dict[str, Resolution]]:
    """The program's output, flash_output and flash_lse over every query head, in the packed step
    layout (total_q, H, d) and (H, total_q), and each one's coarsest printed resolution; a stage
    that cannot be read is left out."""
    out, printed = {}, {}
    for stage in (s for s in KV_CACHE_STAGES if s in run.stages):
        loaded = [load_output(run, stage, h) for h in range(run.dims.heads)]
        if any(m[0] is None for m in loaded):
            continue
        mats = [m[0] for m in loaded]
        out[stage] = (np.stack([m[:, 0] for m in mats]) if STAGES[stage].cols == "1"
                      else np.stack(mats, axis=1))
        printed[stage] = max((m[1] for m in loaded), key=_coarseness)
    return out, printed


def _case_recheck(run, case, check_run: Callable, options, printed: Dict[str, Resolution]) -> Recheck:
    """Re-checks readings of a paged input case: the gathered keys as a packed case of arrays, with
    the run's variant, scale and arithmetic."""

    def recheck(q, k, v, stages, seqs) -> Report:
        dims = replace(run.dims, batch=1, seq_q=seqs.total_q, seq_k=seqs.total_k)
        arrays = {QUERIES: q.transpose(1, 0, 2), KEYS: k.transpose(1, 0, 2), VALUES: v.transpose(1, 0, 2)}
        if run.variant.alibi:
            arrays[ALIBI_SLOPES_INPUT] = np.array([[case.alibi_slope(h) for h in range(run.dims.heads)]])
        sub_case = InputCase(case.path, dims, "npy", scale=run.scale, manifest=True, arrays=arrays,
                             variant=run.variant, sequences=seqs)
        sources = {s: _PrintedArrays(s, None, s, arrays=(x[:, :, None] if STAGES[s].cols == "1"
                                                         else x.transpose(1, 0, 2)), resolution=printed.get(s))
                   for s, x in stages.items()}
        sub_run = RunInfo(None, {}, dims, sources, scale=run.scale, precision=run.precision, math=run.math,
                          half_rounding=run.half_rounding, variant=run.variant)
        return check_run(sub_run, sub_case, options)
    return recheck


def case_cache(case: InputCase, dims) -> KVCache:
    """A paged or packed input case as a KVCache: q packed (total_q, H, d); the pool (num_pages, P,
    Hk, d) after the step's new keys are written and before; each sequence attending to its m(b)
    keys. A packed case is a pool of pages of one key, each sequence's table row its slot's rows."""
    seqs = case.sequences
    P = seqs.page_size or 1
    q = np.stack([case.load(QUERIES, h) for h in range(dims.heads)], axis=1)
    pools = []
    for load in (case.load, case.load_before):
        for name in (KEYS, VALUES):
            pool = np.stack([load(name, h) for h in range(dims.kv)], axis=1)
            pools.append(pool.reshape(-1, P, dims.kv, pool.shape[-1]))
    if seqs.paged:
        table = np.asarray(seqs.block_table, dtype=np.int64).reshape(seqs.count, -1)
    else:
        width = max(1, max(len(seqs.k_slot(b)) for b in range(seqs.count)))
        table = np.full((seqs.count, width), -1, np.int64)
        for b in range(seqs.count):
            table[b, :len(seqs.k_slot(b))] = seqs.k_slot(b)
    lengths = tuple(seqs.cache_len(b) for b in range(seqs.count))
    return KVCache(q, pools[2], pools[3], pools[0], pools[1], table, P, lengths, seqs.new_keys, seqs.paged,
                   cu_q=tuple(seqs.cu_q))


def diagnose_paged_case(report: Report, check_run: Callable, options, load_output: Callable) -> None:
    """The decode-step diagnoses of a checked paged case, or a packed one with new keys, as
    check_kvcache searches them: a failing sequence's output, flash_output and flash_lse re-checked
    on the readings a buggy program makes of its pages (paged_wrong_page, paged_page_shift,
    paged_wrong_table_row, paged_past_length) and of its new keys (new_keys_unseen); then its K and
    V, the cache after the step, explained (diagnose_cache_after)."""
    seqs = report.case.sequences
    if not (seqs.paged or seqs.new_keys) or all(r.passed or r.sequence is None for r in report.results):
        return diagnose_cache_after(report, load_output)
    stages, printed = _program_stages(report.run, load_output)
    if stages:
        kv = case_cache(report.case, report.run.dims)
        diagnose_paged(report, kv, stages, _case_recheck(report.run, report.case, check_run, options, printed))
    diagnose_cache_after(report, load_output)


def _layout(case: InputCase) -> CacheLayout:
    seqs = case.sequences
    lengths = [seqs.cache_len(b) for b in range(seqs.count)]
    if seqs.paged:
        return pool_layout(np.asarray(seqs.block_table, np.int64).reshape(seqs.count, -1), seqs.page_size,
                           seqs.num_pages, lengths, seqs.new_keys)
    return slot_layout(seqs.cu_k, lengths, seqs.new_keys)


def diagnose_cache_after(report: Report, load_output: Callable) -> None:
    """A case with new keys: each failing K or V result (the cache after the step) given the named
    ways the program's cache differs from the cache with the new keys written (cache_not_written,
    cache_write_offset, cache_write_page, cache_clobbered), first."""
    case, run = report.case, report.run
    seqs = case.sequences
    failing = [r for r in report.results if r.status == FAIL and r.stage in NEW_KEY_INPUTS]
    if seqs is None or not seqs.new_keys or not failing:
        return
    layout = _layout(case)
    for stage, head in sorted({(r.stage, r.head) for r in failing}):
        got, resolution, _, _ = load_output(run, stage, head)
        if got is None:
            continue
        quantum = resolution.quantum(got)
        new = read_new_keys(case.path, case.fmt, stage, head, case.dims, seqs)
        # (at bf16/fp16 the program's K and V hold the cache rounded to the format or as read, as their echo check says)
        echo = lambda g, w: echoed(g, w, run.precision, run.half_rounding)  # noqa: E731
        found = cache_findings(got, case.load(stage, head), case.load_before(stage, head), new, layout,
                               f"{stage} K/V head {head}", 0.0 if quantum is None else quantum, echo)
        for r in failing:
            if (r.stage, r.head) == (stage, head):
                r.diagnosis[:0] = [d for d in found if r.sequence is None or d.detail.get("sequence") in (None, r.sequence)]
