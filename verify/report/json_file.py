"""A check's report as JSON (`check --json`): every stage's verdict and every head's comparison."""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..check import flash_attn_criterion
from ..check.results import FLASH_ATTN_KEY, Report
from ..files.case import atomic_write_bytes
from ..runs import program_checks
from .text import arithmetic, notes, resolution_words, stage_status, variant_words, worst_result


def jsonable(x):
    """x with its non-finite floats as strings ("inf", "nan"): JSON has no Infinity or NaN."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "item"):
        return jsonable(x.item())
    return x


def to_json(report: Report) -> dict:
    run, d = report.run, report.run.dims
    first = report.first_failure
    stages = []
    for stage in report.stages:
        rs = report.stage_results(stage)
        w = worst_result(rs)
        heads = {r.head for r in rs}  # (a packed case's head passes when every sequence of it does)
        entry = {"stage": stage, "status": stage_status(rs), "passed": all(r.passed for r in rs),
                 "heads_passed": len(heads - {r.head for r in rs if not r.passed}), "heads": len(heads),
                 "tol_used": w.main.tol_used if w and w.main else None,
                 "max_abs": w.main.max_abs if w and w.main else None,
                 "worst_head": w.head if w else None, "resolution": resolution_words(rs),
                 "print_limited": any(r.print_limited for r in rs),
                 "source": run.sources[stage].describe(), "kv_heads": any(r.kv for r in rs)}
        if getattr(report.case, "sequences", None) is not None:
            entry["worst_sequence"] = w.sequence if w else None
        stages.append(entry)
    return jsonable({
        "passed": report.passed, "first_failing_stage": report.first_failing_stage,
        "first_failure": first.to_json() if first else None,
        "run_id": run.run_id, "backend": run.backend, "device": run.device,
        "precision": run.precision, "math": run.math, "arithmetic": arithmetic(run),
        "causal": run.causal, "scale": run.scale,
        "mismatches": [m.message() for m in run.mismatches], "notes": notes(report),
        "dims": {k: getattr(d, k) for k in ("batch", "heads", "seq_q", "seq_k", "d_k", "d_v", "kv_heads")},
        "sequences": _sequences_json(report),
        "variant": variant_words(run),
        FLASH_ATTN_KEY: flash_attn_criterion.json_block(report),
        "stages": stages, "results": [r.to_json() for r in report.results],
        "foreign_files": report.foreign_files, "timings_ms": report.run.timings(),
        "program_checks": program_checks.json_block(report.program_checks),
        "run_checks": [c.to_json() for c in report.run_checks]})


def _sequences_json(report: Report):
    """A packed case's sequences (flash-attn's offsets; None: not packed)."""
    seqs = getattr(report.case, "sequences", None)
    if seqs is None:
        return None
    out = {"count": seqs.count, "cu_seqlens_q": list(seqs.cu_q),
           "cu_seqlens_k": None if seqs.cu_k is None else list(seqs.cu_k),
           "seqused_k": None if seqs.used_k is None else list(seqs.used_k)}
    if seqs.paged:  # a paged KV cache: the pages each sequence reads
        out.update(page_size=seqs.page_size, block_table=[list(row) for row in seqs.block_table])
    return out


def write_json(report: Report, path: Path) -> None:
    atomic_write_bytes(Path(path), (json.dumps(to_json(report), indent=2) + "\n").encode())
