"""The comparison engine: every stage × head, chained and isolated, with integrity checks.

Each stage of each head is compared twice (issue #3, item 2):
  * chained  — against the float64 reference computed from the original inputs;
  * isolated — against a float64 reference computed from the binary's own upstream outputs.
A stage that fails in isolation is a fault of its own (status FAIL); one that fails only chained,
downstream of a failing stage, has inherited the error (status INHERITED). The first stage, in the
stage table's order, with a fault of its own is the culprit the report names.

Each process checks one head at a time, so memory stays bounded by one head's matrices per process;
large runs share the heads out to forked worker processes (Options.jobs, head_jobs).
"""
from __future__ import annotations

import ctypes
import functools
import multiprocessing
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import diagnose as diag
from . import invariants, tolerance
from .case import CaseError, InputCase, load_input_case, read_bytes
from .outputs import STAGE_ITEMSIZE, Overrides, RunInfo, foreign_stage_files, open_run, staleness
from .reference import compute_stage, reference_chain
from .resolution import EXACT
from .stages import INPUT_NAMES, STAGES

# Statuses of one stage × head; only PASS passes.
PASS, FAIL, INHERITED = "PASS", "FAIL", "INHERITED"
MISSING, STALE, SHAPE, UNREADABLE = "MISSING", "STALE", "SHAPE", "UNREADABLE"
MAX_LISTED_MISMATCHES = 5


@dataclass
class Options:
    """Tolerance overrides: (atol, rtol) replace the error model for every stage or one stage."""
    atol: Optional[float] = None
    rtol: Optional[float] = None
    per_stage: Dict[str, Tuple[float, float]] = field(default_factory=dict)
    only_stages: Optional[Sequence[str]] = None
    jobs: int = 0  # worker processes over heads; 0: as many as cores and memory allow
    # What the run is checked against, when the command line says (else the input case / run.toml).
    causal: Optional[bool] = None
    scale: Optional[float] = None
    precision: Optional[str] = None
    math: str = "ieee"
    names: Dict[str, str] = field(default_factory=dict)  # stage -> file name pattern in OUT

    allow_nonfinite: bool = False  # NaN/inf inputs load; NaN then matches a NaN reference

    def overrides(self) -> Overrides:
        return Overrides(self.causal, self.scale, self.precision, self.math, dict(self.names))

    def override(self, stage: str) -> Optional[Tuple[float, float]]:
        if stage in self.per_stage:
            return self.per_stage[stage]
        if self.atol is not None or self.rtol is not None:
            return (self.atol or 0.0, self.rtol or 0.0)
        return None


@dataclass
class Comparison:
    """One comparison of got against want under an element-wise allowance."""
    passed: bool
    total: int
    mismatched: int
    max_abs: float
    max_rel: float
    worst: Optional[Tuple[int, int]]
    got: float
    want: float
    allowed: float
    tol_used: float   # max |got - want| / allowed: < 1 passes; the headroom is 1 - tol_used
    min_atol: float   # the smallest absolute tolerance that would have passed
    first: List[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in ("passed", "total", "mismatched", "max_abs", "max_rel",
                                             "tol_used", "min_atol")}
        d["worst"] = None if self.worst is None else {
            "row": self.worst[0], "col": self.worst[1], "got": self.got, "want": self.want,
            "allowed": self.allowed}
        d["first_mismatches"] = self.first
        return d


def elementwise_error(got: np.ndarray, want: np.ndarray, nan_agrees: bool = False) -> np.ndarray:
    """|got - want| where equal infinities count as 0 and NaN stays NaN (NaN never passes);
    nan_agrees: NaN where want is NaN counts as 0 (an isolated reference computed from a binary's
    own NaN: the stage propagated what it was given)."""
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.subtract(got, want)
        np.abs(err, out=err)
    np.copyto(err, 0.0, where=(got == want))  # equal infinities included
    if nan_agrees:
        np.copyto(err, 0.0, where=np.isnan(got) & np.isnan(want))
    return err


def _ratio(err: np.ndarray, denom: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """err / denom, 0 where err is 0 and +inf where that is NaN (0/0 aside, NaN never passes)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.divide(err, denom)
    np.copyto(ratio, 0.0, where=zero)
    np.copyto(ratio, np.inf, where=np.isnan(ratio))
    return ratio


def _nan_as_inf(x: float) -> float:
    return np.inf if np.isnan(x) else x


def _first_indices(bad: np.ndarray, limit: int) -> List[Tuple[int, int]]:
    """The first `limit` True entries of `bad` in row-major order (np.argwhere(bad)[:limit]
    without listing every bad entry of a matrix that fails everywhere)."""
    out: List[Tuple[int, int]] = []
    for i in np.flatnonzero(bad.any(axis=1)):
        out.extend((int(i), int(j)) for j in np.flatnonzero(bad[i])[:limit - len(out)])
        if len(out) >= limit:
            break
    return out


# Elements per row block of a comparison: a block's temporaries stay in the CPU cache, which makes
# comparing a 4096² head several times faster than whole-matrix temporaries.
_COMPARE_BLOCK_ELEMS = 1 << 16


def compare_arrays(got: np.ndarray, want: np.ndarray, allowed: np.ndarray,
                   nan_agrees: bool = False) -> Comparison:
    """got against want under `allowed` (all of one 2-D shape), row block by row block."""
    if got.size == 0:
        return Comparison(True, 0, 0, 0.0, 0.0, None, 0.0, 0.0, 0.0, 0.0, 0.0)
    cols = got.shape[1]
    rows = max(1, _COMPARE_BLOCK_ELEMS // max(1, cols))
    mismatched, first_idx = 0, []
    tol_used, worst = -1.0, (0, 0)    # every ratio is ≥ 0: the first block sets both
    max_rel = max_abs = 0.0
    for r0 in range(0, got.shape[0], rows):
        g, w, a = got[r0:r0 + rows], want[r0:r0 + rows], allowed[r0:r0 + rows]
        err = elementwise_error(g, w, nan_agrees)
        bad = ~(err <= a)  # NaN compares False, so it is bad
        n_bad = int(np.count_nonzero(bad))
        if n_bad and len(first_idx) < MAX_LISTED_MISMATCHES:
            first_idx += [(r0 + i, j) for i, j in _first_indices(bad, MAX_LISTED_MISMATCHES - len(first_idx))]
        mismatched += n_bad
        zero = err == 0
        ratio = _ratio(err, a, zero)
        k = int(np.argmax(ratio))      # the first largest; a later block must beat it strictly
        if ratio.flat[k] > tol_used:
            tol_used, worst = float(ratio.flat[k]), (r0 + k // cols, k % cols)
        max_rel = max(max_rel, float(_ratio(err, np.abs(w), zero).max()))
        max_abs = max(max_abs, _nan_as_inf(float(err.max())))  # a NaN error counts as +inf
    r, c = worst
    first = [{"row": i, "col": j, "got": float(got[i, j]), "want": float(want[i, j]),
              "allowed": float(allowed[i, j])} for i, j in first_idx]
    return Comparison(
        passed=mismatched == 0, total=int(got.size), mismatched=mismatched,
        max_abs=max_abs, max_rel=max_rel, worst=(r, c),
        got=float(got[r, c]), want=float(want[r, c]), allowed=float(allowed[r, c]),
        tol_used=tol_used, min_atol=max_abs, first=first)


@dataclass
class HeadResult:
    stage: str
    head: int
    batch: int
    head_in_batch: int
    status: str
    chained: Optional[Comparison] = None
    isolated: Optional[Comparison] = None
    violations: List[invariants.Violation] = field(default_factory=list)
    notes: List[invariants.Violation] = field(default_factory=list)  # found, but blamed elsewhere
    diagnosis: List[diag.Diagnosis] = field(default_factory=list)
    message: str = ""
    resolution: str = EXACT.describe()  # how finely the file records its values
    print_limited: bool = False  # its printed resolution, not float32, bounds what can be checked

    @property
    def passed(self) -> bool:
        return self.status == PASS

    @property
    def main(self) -> Optional[Comparison]:
        """The comparison that explains the status: isolated for own faults, else chained."""
        if self.status == FAIL and self.isolated is not None and not self.isolated.passed:
            return self.isolated
        return self.chained

    def to_json(self) -> dict:
        main = self.main
        d = {"stage": self.stage, "head": self.head, "batch": self.batch,
             "head_in_batch": self.head_in_batch, "passed": self.passed, "status": self.status,
             "inherited": self.status == INHERITED, "message": self.message}
        d.update(main.to_json() if main else {"total": 0, "mismatched": None})
        d["chained"] = self.chained.to_json() if self.chained else None
        d["isolated"] = self.isolated.to_json() if self.isolated else None
        d["violations"] = [{"code": v.code, "message": v.message, "count": v.count} for v in self.violations]
        d["notes"] = [{"code": v.code, "message": v.message, "count": v.count} for v in self.notes]
        d["diagnosis"] = [{"code": x.code, "message": x.message, "detail": x.detail} for x in self.diagnosis]
        d["resolution"] = self.resolution
        d["print_limited"] = self.print_limited
        return d


@dataclass
class Report:
    run: RunInfo
    case: InputCase
    results: List[HeadResult]
    foreign_files: List[str]

    @property
    def stages(self) -> List[str]:
        seen: List[str] = []
        for r in self.results:
            if r.stage not in seen:
                seen.append(r.stage)
        return seen

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def first_failure(self) -> Optional[HeadResult]:
        """The culprit: the first stage (table order), then head, failing on its own."""
        own = [r for r in self.results if r.status not in (PASS, INHERITED)]
        if not own:
            own = [r for r in self.results if not r.passed]
        order = {s: i for i, s in enumerate(STAGES)}
        return min(own, key=lambda r: (order[r.stage], r.head)) if own else None

    @property
    def first_failing_stage(self) -> Optional[str]:
        f = self.first_failure
        return f.stage if f else None

    def stage_results(self, stage: str) -> List[HeadResult]:
        return [r for r in self.results if r.stage == stage]


# ----------------------------------------------------------------------------------------------

def _load_output(run: RunInfo, stage: str, head: int):
    """(matrix or None, its Resolution, HeadResult-status or None, message) for one stage × head."""
    src = run.sources[stage]
    data = None
    if src.arrays is None and (src.per_head or not src.file(head, run.dims).exists()):
        path = src.file(head, run.dims)
        if not path.exists():
            why = f"run.toml lists stage {stage}" if "stages" in run.values else \
                f"the other {stage} files exist"
            return None, EXACT, MISSING, f"{path.name} is missing ({why})"
        try:
            data = read_bytes(path, STAGES[stage].shape(run.dims), STAGE_ITEMSIZE)  # a FIFO, a device, too large
        except CaseError as exc:
            return None, EXACT, UNREADABLE, str(exc)
        stale = staleness(run, stage, head, data)
        if stale:
            return None, EXACT, STALE, stale
    try:
        mat, resolution, _ = src.read(head, run.dims, data)
    except CaseError as exc:
        return None, EXACT, UNREADABLE, str(exc)
    shape = STAGES[stage].shape(run.dims)
    if mat.shape != shape:
        return None, EXACT, SHAPE, (f"{src.name(head, run.dims)} is {mat.shape[0]}x{mat.shape[1]}, expected "
                                    f"{shape[0]}x{shape[1]} ({STAGES[stage].rows}x{STAGES[stage].cols})")
    return mat, resolution, None, ""


def _model(run: RunInfo) -> dict:
    """The tolerance model's arguments for this run."""
    return dict(scale=run.scale, causal=run.causal, precision=run.precision, backend=run.backend,
                math=run.math)


def _allowed(stage: str, src: Dict[str, np.ndarray], want: np.ndarray, run: RunInfo,
             opts: Options, chain: Optional[Dict[str, np.ndarray]] = None,
             cache: Optional[tolerance.HeadCache] = None) -> np.ndarray:
    """The element-wise allowance: the user's atol + rtol·|want| where given, else the error model:
    isolated (this stage's own rounding, from `src`) or, with `chain`, the error accumulated along
    the reference chain from the original inputs. cache: the head's tolerance.HeadCache."""
    ov = opts.override(stage)
    if ov is not None:
        atol, rtol = ov
        return atol + rtol * np.where(np.isfinite(want), np.abs(want), 0.0)
    if chain is not None:
        return tolerance.chained_bound(stage, chain, **_model(run), cache=cache)
    return tolerance.stage_bound(stage, src, want, **_model(run), cache=cache)


def _with_quantum(allowed: np.ndarray, *extra) -> np.ndarray:
    """allowed plus the printed-resolution terms that apply (None or 0: exact)."""
    out = allowed
    for x in extra:
        if x is not None and not (np.isscalar(x) and x == 0):
            out = out + x
    return out


def _isolated_sources(names, got, quanta, results, chain):
    """The sources of a stage's isolated reference: the binary's own upstream stages where it wrote
    them, except echoes that matched their input (the exact input then), and the reference where a
    stage was not written (an unchecked upstream stage is simply not checked)."""
    src, q = {}, {}
    for n in names:
        own = n in got and not (n in INPUT_NAMES and results[n].passed)
        src[n] = got[n] if own else chain[n]
        if own and quanta.get(n) is not None:
            q[n] = quanta[n]
    return src, q


def _bit_identical(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]) -> bool:
    """Whether two source sets hold the very same bits (so every reference and bound computed
    from them is the same too): -0.0 vs 0.0 and NaN payloads count as different."""
    return a.keys() == b.keys() and all(
        a[n] is b[n] or (a[n].shape == b[n].shape and a[n].dtype == b[n].dtype
                         and np.ascontiguousarray(a[n]).tobytes() == np.ascontiguousarray(b[n]).tobytes())
        for n in a)


def _upstream(stage: str) -> List[str]:
    """Every stage this one is computed from, transitively."""
    out: List[str] = []
    for name in STAGES[stage].inputs:
        for up in _upstream(name) + [name]:
            if up not in out:
                out.append(up)
    return out


# Consistency checks between the flash stages and the stage path: when they disagree and the
# stage-path partner already failed, the partner is at fault and the flash stage is not blamed.
_CONSISTENCY_PARTNER = {invariants.FLASH_VS_OUTPUT: "output", invariants.LSE_VS_SCORES: "QK_scaled"}


def _blamed_elsewhere(violations, results: Dict[str, "HeadResult"]) -> List[invariants.Violation]:
    return [v for v in violations if v.code in _CONSISTENCY_PARTNER
            and _CONSISTENCY_PARTNER[v.code] in results
            and not results[_CONSISTENCY_PARTNER[v.code]].passed]


def _uses_scale_and_mask(stage: str) -> bool:
    return stage == "QK_scaled" or "QK_scaled" in _upstream(stage) or STAGES[stage].flash


def check_head(run: RunInfo, case: InputCase, head: int, opts: Options,
               ref_of_head: Callable[[str, int], np.ndarray]) -> List[HeadResult]:
    dims, scale, causal = run.dims, run.scale, run.causal
    inputs = {name: case.load(name, head).astype(np.float64) for name in INPUT_NAMES}
    stages = [s for s in run.stages if opts.only_stages is None or s in opts.only_stages]
    needed = set(stages).union(*(_upstream(s) for s in stages))  # partial runs: upstream too
    chain = {**inputs, **reference_chain(inputs, scale, causal, needed)}
    b, h = dims.decode_head(head)
    got: Dict[str, np.ndarray] = {}
    quanta: Dict[str, Optional[np.ndarray]] = {}
    results: Dict[str, HeadResult] = {}
    # Logits, softmax parts, dot-product variances, … shared by this head's bounds (the isolated
    # and chained checks, both flash stages and the invariants), keyed by array identity: none of
    # the arrays below is modified while it lives.
    cache = tolerance.HeadCache()
    for stage in stages:
        res = HeadResult(stage, head, b, h, PASS)
        results[stage] = res
        mat, resolution, bad_status, msg = _load_output(run, stage, head)
        if mat is None:
            res.status, res.message = bad_status, msg
            code = {STALE: "stale", MISSING: "missing", SHAPE: "shape", UNREADABLE: "unreadable"}[bad_status]
            res.diagnosis.append(diag.Diagnosis(code, msg, {}))
            continue
        res.resolution = resolution.describe()
        quantum = resolution.quantum(mat) if opts.override(stage) is None else None
        got[stage], quanta[stage] = mat, quantum
        names = STAGES[stage].inputs or (stage,)  # an echo's reference is the input file itself
        src_chain = {n: chain[n] for n in names}
        src_iso, q_iso = _isolated_sources(names, got, quanta, results, chain)
        want_chain = chain[stage]
        model_chain = _allowed(stage, src_chain, want_chain, run, opts, chain, cache)
        allowed_chain = _with_quantum(model_chain, quantum)
        res.chained = compare_arrays(mat, want_chain, allowed_chain, opts.allow_nonfinite)
        res.print_limited = quantum is not None and bool(np.any(quantum > model_chain))
        if stage not in tolerance.PROPAGATED_STAGES and not q_iso and _bit_identical(src_iso, src_chain):
            # The binary read exactly the reference's sources (its echoes are exact): the isolated
            # reference and bound are the chained ones, so is the comparison.
            want_iso, allowed_iso, res.isolated = want_chain, allowed_chain, res.chained
        else:
            want_iso = compute_stage(stage, src_iso, scale, causal)
            propagated = tolerance.quantization_bound(stage, src_iso, q_iso, scale) \
                if opts.override(stage) is None else None
            allowed_iso = _with_quantum(_allowed(stage, src_iso, want_iso, run, opts, cache=cache),
                                        quantum, propagated)
            res.isolated = compare_arrays(mat, want_iso, allowed_iso, nan_agrees=True)
        ctx = {"dims": dims, "scale": scale, "causal": causal, "precision": run.precision,
               "backend": run.backend, "math": run.math, "inputs": inputs, "input": inputs.get(stage),
               "K_got": got.get("K", inputs["K"]), "output_got": got.get("output"),
               "QK_scaled_got": got.get("QK_scaled"), "chain": chain, "tolerance_cache": cache,
               "quantum": quantum, "quanta": quanta, "allow_nonfinite": opts.allow_nonfinite}
        res.violations = invariants.check_invariants(stage, mat, ctx)
        if res.isolated.passed and _nonfinite_propagated(mat, want_iso):
            res.violations = [v for v in res.violations if v.code != invariants.NONFINITE]
        res.notes = _blamed_elsewhere(res.violations, results)
        res.violations = [v for v in res.violations if v not in res.notes]
        _classify(res, results)
        if res.status == FAIL:
            res.diagnosis = diag.diagnose(stage, mat, want_iso, {
                "dims": dims, "scale": scale, "causal": causal, "head": head, "src": src_iso,
                "ref_of_head": functools.partial(ref_of_head, stage), "flash_tiles": run.flash_tiles,
                "bound": allowed_iso})
            for v in res.violations:
                if not any(d.code == v.code for d in res.diagnosis):
                    res.diagnosis.append(diag.Diagnosis(v.code, v.message, {"count": v.count}))
    return list(results.values())


def _nonfinite_propagated(got: np.ndarray, want_iso: np.ndarray) -> bool:
    """Every NaN/Inf of got stands where the isolated reference has one: the stage propagated
    what its upstream stages gave it (their own checks report the cause)."""
    return bool(np.all(np.isfinite(got) | ~np.isfinite(want_iso)))


def _classify(res: HeadResult, results: Dict[str, HeadResult]) -> None:
    """FAIL when the stage fails on its own: neither its own upstream files nor the original inputs
    explain it (a correct program may compute a stage by another route than from the upstream
    files it wrote: QK_scaled as (Q·scale)·Kᵀ, a fused softmax), or a reference-free check fails.
    INHERITED when it fails only chained, downstream of a failing stage."""
    upstream_failed = [u for u in _upstream(res.stage) if u in results and not results[u].passed]
    explained = res.isolated.passed or res.chained.passed
    if not explained or res.violations:
        res.status = FAIL
    elif not res.chained.passed:
        res.status = INHERITED if upstream_failed else FAIL
        res.message = (f"inherits the error of {upstream_failed[0]}" if upstream_failed else
                       "fails against the reference chain only: error accumulated upstream")
    elif not res.isolated.passed:
        res.message = ("matches the reference from the original inputs (computed by another route "
                       "than from the upstream stages it wrote)")


def apply_mismatches(run: RunInfo, results: List[HeadResult]) -> None:
    """A run.toml that says the run computed another causal mode or scale than the input case asks
    for fails every stage that depends on them, with the mismatch as its first diagnosis."""
    for mm in run.mismatches:
        for r in results:
            if not _uses_scale_and_mask(r.stage):
                continue
            r.diagnosis.insert(0, diag.Diagnosis(f"{mm.key}_mismatch", mm.message(),
                                                 {"run": mm.run_value, "input": mm.input_value}, 0.99))
            if r.status == PASS:
                r.status, r.message = FAIL, mm.message()


# Memory one worker holds while it checks a head, in float64 N×M matrices (the reference chain,
# the binary's stages, bounds and the error model's intermediates; measured: 4.1 GB peak for one
# 4096×4096 head, ~30 matrices) and in (N + M)·d ones, plus the interpreter and numpy.
_HEAD_NM_MATRICES = 32
_HEAD_ND_MATRICES = 32
_WORKER_BASE_BYTES = 200 << 20
# Other heads' reference stages a process keeps for the head_permuted diagnosis (one matrix each).
_REF_CACHE = 8
# Below this many multiply-adds over all heads (the default 12×128×128 case has 25 M) one process
# checks faster than a pool can start.
_PARALLEL_MIN_MACS = 1 << 23


def _read_int(path: str, field: int = 0) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().split()[field])
    except (OSError, ValueError, IndexError):
        return None  # absent, or "max" (no limit)


def _available_memory_bytes() -> Optional[int]:
    """MemAvailable, and no more than a container's memory limit leaves (cgroup v2, else v1)."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < (1 << 60):
            left = max(0, limit - usage)
            avail = left if avail is None else min(avail, left)
            break
    return avail


def _usable_cores() -> int:
    """The cores this process may run on, and no more than a container's CPU quota (cgroup v2)."""
    cores = len(os.sched_getaffinity(0))
    quota, period = _read_int("/sys/fs/cgroup/cpu.max", 0), _read_int("/sys/fs/cgroup/cpu.max", 1)
    if quota is not None and period:
        cores = min(cores, max(1, -(-quota // period)))
    return cores


def head_jobs(run: RunInfo, requested: int = 0) -> int:
    """Worker processes for checking the heads of `run`: `requested` if positive, else as many as
    there are cores, limited so that the workers' heads fit in half the available memory, and 1
    for small runs. 1 off Linux: the workers are forked (they inherit the loaded case)."""
    d = run.dims
    if d.total_heads <= 1 or sys.platform != "linux":
        return 1
    if requested > 0:
        return min(requested, d.total_heads)
    if d.total_heads * d.seq_q * d.seq_k * (d.d_k + d.d_v) < _PARALLEL_MIN_MACS:
        return 1  # starting workers would cost more than the checking
    cores = _usable_cores()
    per_head = (8 * ((_HEAD_NM_MATRICES + _REF_CACHE) * d.seq_q * d.seq_k
                     + _HEAD_ND_MATRICES * (d.seq_q + d.seq_k) * max(d.d_k, d.d_v))
                + _WORKER_BASE_BYTES)
    avail = _available_memory_bytes()
    by_memory = cores if avail is None else max(1, (avail // 2) // per_head)
    return max(1, min(cores, by_memory, d.total_heads))


class _HeadChecker:
    """Checks one head of a run; holds what every head shares (and, per process, the reference
    stages of other heads that the head_permuted diagnosis compared against last: one matrix
    each, REF_CACHE of them, counted in head_jobs' memory budget)."""

    def __init__(self, run: RunInfo, case: InputCase, opts: Options) -> None:
        self.run, self.case, self.opts = run, case, opts
        self.ref_of_head = functools.lru_cache(maxsize=_REF_CACHE)(self._reference)

    def _reference(self, stage: str, head: int) -> np.ndarray:
        inputs = {n: self.case.load(n, head) for n in INPUT_NAMES}
        return reference_chain(inputs, self.run.scale, self.run.causal,
                               [stage])[stage]  # (its upstream stages are computed and dropped)

    def check(self, head: int) -> List[HeadResult]:
        # Non-finite inputs, when allowed, make the error model's arithmetic meet inf and NaN.
        with np.errstate(all="ignore") if self.opts.allow_nonfinite else np.errstate():
            return check_head(self.run, self.case, head, self.opts, self.ref_of_head)


_CHECKER: Optional[_HeadChecker] = None  # the parent's checker, inherited by forked workers


def _die_with_parent() -> None:
    """Pool initializer: a worker gets SIGTERM when the check that forked it dies (a plain kill of
    the parent would otherwise leave it waiting on its queue for ever)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before the line above took effect
        os._exit(1)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _check_in_worker(head: int) -> List[HeadResult]:
    assert _CHECKER is not None, "worker started without a checker"
    return _CHECKER.check(head)


def check(in_dir: Path, out_dir: Path, opts: Optional[Options] = None,
          progress: Optional[Callable[[int], None]] = None) -> Report:
    """Loads both cases, checks their agreement, and compares every stage × head."""
    opts = opts or Options()
    case = load_input_case(in_dir)
    case.allow_nonfinite = opts.allow_nonfinite
    run = open_run(out_dir, case, opts.overrides())
    return check_run(run, case, opts, progress)


def check_run(run: RunInfo, case: InputCase, opts: Options,
              progress: Optional[Callable[[int], None]] = None) -> Report:
    """Compares every stage × head of an opened run (files or the Python API's arrays)."""
    if opts.only_stages:
        unknown = [s for s in opts.only_stages if s not in STAGES]
        if unknown:
            raise CaseError(f"unknown stage '{unknown[0]}'; stages are: {', '.join(STAGES)}")
        absent = [s for s in opts.only_stages if s not in run.stages]
        if absent:
            raise CaseError(f"--stage {absent[0]}: {run.path or 'the run'} holds no {absent[0]} (it has "
                            f"{', '.join(run.stages)}); nothing would be checked")
    checker = _HeadChecker(run, case, opts)
    results: List[HeadResult] = []
    heads = range(run.dims.total_heads)
    jobs = head_jobs(run, opts.jobs)
    if jobs <= 1:
        for head in heads:
            results.extend(checker.check(head))
            if progress:
                progress(head)
    else:
        global _CHECKER
        _CHECKER = checker  # forked workers inherit it: nothing large is pickled to them
        try:
            with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"),
                                     initializer=_die_with_parent) as pool:
                for head, head_results in enumerate(pool.map(_check_in_worker, heads)):
                    results.extend(head_results)
                    if progress:
                        progress(head)
        except BrokenProcessPool:
            raise CaseError(f"a checking process of {jobs} died (killed for memory?); HINT: run check "
                            "with --jobs 1, or fewer") from None
        finally:
            _CHECKER = None
    apply_mismatches(run, results)
    return Report(run, case, results, foreign_stage_files(run))


def error_ratio_map(run: RunInfo, case: InputCase, stage: str, head: int,
                    opts: Optional[Options] = None) -> np.ndarray:
    """|got - want| / allowed of one stage × head against its isolated reference (for plots)."""
    opts = opts or Options()
    inputs = {n: case.load(n, head).astype(np.float64) for n in INPUT_NAMES}
    got, resolution, _, msg = _load_output(run, stage, head)
    if got is None:
        raise CaseError(msg)
    src = {}
    for n in STAGES[stage].inputs or (stage,):
        up = _load_output(run, n, head)[0] if n in run.stages and n not in INPUT_NAMES else None
        src[n] = up if up is not None else reference_chain(inputs, run.scale, run.causal, [n])[n]
    want = compute_stage(stage, src, run.scale, run.causal)
    allowed = _with_quantum(_allowed(stage, src, want, run, opts), resolution.quantum(got))
    err = elementwise_error(got, want)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err == 0, 0.0, err / allowed)
    return np.where(np.isnan(ratio), np.inf, ratio)
