#!/usr/bin/env python3
"""catch_rate.py — how often `check` catches one wrong element in a long row.

    python3 scripts/catch_rate.py [--keys 1024,8192,32768] [--rows 32] [--d 64] [--trials 100]
                                  [--json docs/catch_rate.json] [--markdown FILE]
                                  [--exact-energy-macs MACS]   (an experiment: docs/performance.md)

For each input distribution and key count M: generate one head (N query rows, M keys, d wide, not
causal, with dO), run the binary's CPU backend on it (a correct float32 run of every stage), and
check it once as `attnstep check` does. Then, for every stage with an error model, over `--trials`
trials: move one element (at random, with a random sign) by 10× the stage's typical error and ask
the check engine's own per-stage decision whether the stage fails and where. The typical error is
the RMS over the stage's finite elements of |run − float64 reference from the original inputs|.

The decision is the check's, not a copy of it: each trial runs compare._check_stage, the step
check_head takes per stage (the chained and the isolated comparison, the reference-free checks,
the verdict), on the head's context built once per case, whose cache keeps the references and
bounds computed from the untouched sources; whatever a trial adds to it from the planted matrix is
dropped after the trial. tests/test_catch_rate.py checks, at a small size, that every trial's
verdict is the whole `check`'s on the planted files.

Results and what they show: docs/performance.md, "Power on long rows". The binary: $ATTNSTEP_BINARY where set, else build/main (built when needed), as the tests find it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from verify.check import compare  # noqa: E402
from verify.check.compare import Options, _check_stage, _HeadChecker, _open_head  # noqa: E402
from verify.check.results import FAIL, PASS, HeadResult  # noqa: E402
from verify.check.stage_check import (allowed, isolated_sources, load_output, new_result, query_keys_values,  # noqa: E402
                                      reference, sources)
from verify.files.case import load_input_case  # noqa: E402
from verify.files.outputs import open_run  # noqa: E402
from verify.model import dot  # noqa: E402
from verify.specs import SPECS  # noqa: E402
from verify.stages import STAGES  # noqa: E402

DISTRIBUTIONS = ("uniform", "normal", "large")
# Every stage a correct run can be wrong in: not the exact copies, the splits or the keep-mask.
PLANTED = tuple(s for s, st in STAGES.items()
                if SPECS[s].isolated is not None and not st.split and not st.dropout)
ORDER = {s: i for i, s in enumerate(STAGES)}
FACTOR = 10.0  # the planted error, in units of the stage's typical error
GOAL = 0.95


def find_binary() -> Path:
    """$ATTNSTEP_BINARY (a prebuilt binary) or build/main, built when needed."""
    given = os.environ.get("ATTNSTEP_BINARY")
    if given:
        return Path(given).resolve()
    from verify.runs.runner import ensure_built
    return ensure_built(REPO / "build")


def make_run(work: Path, binary: Path, dist: str, keys: int, rows: int, d: int, seed: int) -> Tuple[Path, Path]:
    """An input case (one head, with dO) and the binary's CPU run of every stage on it."""
    in_dir, out_dir = work / f"{dist}_{keys}_in", work / f"{dist}_{keys}_out"
    subprocess.run([sys.executable, "-m", "verify", "generate", "--out", str(in_dir), "--heads", "1",
                    "--seq-q", str(rows), "--seq-k", str(keys), "--d-k", str(d), "--d-v", str(d), "--dist", dist,
                    "--seed", str(seed), "--backward", "--format", "npy", "--force"],
                   check=True, stdout=subprocess.DEVNULL, cwd=REPO)
    subprocess.run([str(binary), "--in", str(in_dir), "--out", str(out_dir), "--backend", "cpu", "--format", "npy"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return in_dir, out_dir


class Head:
    """One head's check, kept across trials: the run, the head's context (references, bounds and
    their cache) and every stage's verdict on the untouched run."""

    def __init__(self, in_dir: Path, out_dir: Path) -> None:
        self.opts = Options(jobs=1)
        self.case = load_input_case(in_dir)
        self.run = open_run(out_dir, self.case, self.opts.overrides())
        self.stages = list(self.run.stages)
        self.ctx = _open_head(self.run, self.case, 0, self.opts, self.stages)[0]
        self.diagnosis = (_HeadChecker(self.run, self.case, self.opts, None).ref_of_head,
                          lambda head: query_keys_values(self.run, self.case, head), self.case.alibi_slope, None)
        self.clean: Dict[str, tuple] = {}
        self.results: Dict[str, HeadResult] = {}
        self.bounds: Dict[tuple, tuple] = {}
        engine_allowed = compare.allowed
        compare.allowed = lambda *args, **kw: self._allowed(engine_allowed, None, *args, **kw)
        try:
            for stage in self.stages:  # check_head's loop, for a head of its own
                self.clean[stage] = load_output(self.run, stage, 0)
                res = self.results[stage] = new_result(self.run, stage, 0)
                _check_stage(res, self.clean[stage], self.ctx, self.results, self.run, self.opts, self.diagnosis)
        finally:
            compare.allowed = engine_allowed

    def decide(self, stage: str, mat: np.ndarray) -> HeadResult:
        """The check's verdict on `stage` holding `mat`, every other stage as the run wrote it."""
        before = {s: r for s, r in self.results.items() if ORDER[s] < ORDER[stage]}
        res = new_result(self.run, stage, 0)
        memo = self.ctx.cache._memo
        known = set(memo)
        engine_allowed = compare.allowed
        compare.allowed = lambda *args, **kw: self._allowed(engine_allowed, mat, *args, **kw)
        try:
            _check_stage(res, (mat,) + self.clean[stage][1:], self.ctx, before, self.run, self.opts, self.diagnosis)
        finally:
            compare.allowed = engine_allowed
            self.ctx.got[stage] = self.clean[stage][0]
            self.ctx.quanta[stage] = self.clean[stage][1].quantum(self.clean[stage][0])
            for key in set(memo) - known:  # what the planted matrix added: its id may be reused
                if any(a is mat for a in memo[key][0]):
                    del memo[key]
        return res

    def _allowed(self, engine_allowed, planted, stage, src, want, ctx, override, chained=False):
        """The engine's allowance (stage_check.allowed), computed once per stage and comparison:
        it is a function of the stage's sources alone (its reference is computed from them), which
        no trial changes. Kept with the sources, so that their ids stay theirs."""
        if any(a is planted for a in src.values()):
            return engine_allowed(stage, src, want, ctx, override, chained)
        key = (stage, chained, override, tuple(sorted((n, id(a)) for n, a in src.items())))
        if key not in self.bounds:
            self.bounds[key] = (dict(src), engine_allowed(stage, src, want, ctx, override, chained))
        return self.bounds[key][1]

    def allowance(self, stage: str) -> np.ndarray:
        """Per element, the larger of the isolated and the chained allowance of the untouched run
        (the stage passes where either comparison does): what a planted error must beat, for the
        report (the decision is decide()'s)."""
        names = sources(stage, self.ctx)
        chain = self._allowed(allowed, None, stage, {n: self.ctx.chain[n] for n in names}, self.ctx.chain[stage],
                              self.ctx, None, True)
        before = {s: r for s, r in self.results.items() if ORDER[s] < ORDER[stage]}
        src, _ = isolated_sources(names, self.ctx.got, self.ctx.quanta, before, self.ctx.chain)
        iso = self._allowed(allowed, None, stage, src, reference(stage, src, self.ctx), self.ctx, None)
        return np.maximum(iso, chain)

    def typical_error(self, stage: str) -> float:
        """RMS of |run − float64 reference from the original inputs| over the finite elements."""
        got, want = self.clean[stage][0], self.ctx.chain[stage]
        finite = np.isfinite(want)
        return float(np.sqrt(np.mean((got[finite] - want[finite]) ** 2)))


def located(res: HeadResult, at: Tuple[int, int]) -> bool:
    """Whether a failing comparison names the planted element (its worst or a listed mismatch)."""
    for comp in (res.isolated, res.chained):
        if comp is not None and not comp.passed:
            if comp.worst == at or any((m["row"], m["col"]) == at for m in comp.first):
                return True
    return False


@dataclass
class Cell:
    stage: str
    dist: str
    keys: int
    typical: float
    trials: int = 0
    caught: int = 0
    named: int = 0
    clean_passes: bool = True
    allowance_over_typical: float = float("nan")  # the median element's allowance / the typical error
    predicted: float = float("nan")  # the share of elements whose allowance is below FACTOR × typical

    def rate(self) -> float:
        return self.caught / self.trials if self.trials else float("nan")

    def stderr(self) -> float:
        p = self.rate()
        return math.sqrt(p * (1 - p) / self.trials) if self.trials else float("nan")

    def to_json(self) -> dict:
        return {"stage": self.stage, "distribution": self.dist, "keys": self.keys, "typical_error_rms": self.typical,
                "trials": self.trials, "caught": self.caught, "caught_and_named": self.named,
                "catch_rate": self.rate(), "binomial_stderr": self.stderr(), "clean_run_passes": self.clean_passes,
                "allowance_over_typical_median": self.allowance_over_typical,
                "share_of_elements_allowing_less_than_planted": self.predicted}


def plant_trials(head: Head, stage: str, dist: str, keys: int, trials: int, rng: np.random.Generator,
                 factor: float = FACTOR) -> Cell:
    """`trials` single-element plants of `factor` × the typical error into `stage`."""
    clean = head.clean[stage][0]
    cell = Cell(stage, dist, keys, head.typical_error(stage), clean_passes=head.results[stage].status == PASS)
    candidates = np.flatnonzero(np.isfinite(head.ctx.chain[stage]).ravel())
    ratio = head.allowance(stage).ravel()[candidates] / cell.typical
    cell.allowance_over_typical = float(np.median(ratio))
    cell.predicted = float(np.mean(ratio < factor))
    for _ in range(trials):
        flat = int(rng.choice(candidates))
        at = divmod(flat, clean.shape[1])
        planted = np.array(clean, dtype=np.float64)
        planted[at] += rng.choice((-1.0, 1.0)) * factor * cell.typical
        res = head.decide(stage, planted)
        cell.trials += 1
        cell.caught += res.status == FAIL
        cell.named += res.status == FAIL and located(res, at)
    return cell


def measure(binary: Path, work: Path, keys: Sequence[int], rows: int, d: int, trials: int, seed: int,
            dists: Sequence[str] = DISTRIBUTIONS, stages: Sequence[str] = PLANTED, log=print) -> List[Cell]:
    cells = []
    for dist in dists:
        for m in keys:
            t0 = time.perf_counter()
            head = Head(*make_run(work, binary, dist, m, rows, d, seed))
            rng = np.random.default_rng([seed, m, DISTRIBUTIONS.index(dist)])
            for stage in stages:
                cells.append(plant_trials(head, stage, dist, m, trials, rng))
            log(f"catch_rate: {dist} M={m}: {time.perf_counter() - t0:.1f} s; "
                + " ".join(f"{c.stage} {c.rate():.2f}" for c in cells[-len(stages):]))
    return cells


def markdown(cells: List[Cell], keys: Sequence[int], dists: Sequence[str]) -> str:
    """Stages down, distribution × M across: the catch rate (named, where fewer were)."""
    by = {(c.stage, c.dist, c.keys): c for c in cells}
    stages = [s for s in PLANTED if any(c.stage == s for c in cells)]
    head = "| stage | " + " | ".join(f"{dist} {m}" for dist in dists for m in keys) + " |"
    lines = [head, "|" + "---|" * (1 + len(dists) * len(keys))]
    for s in stages:
        row = []
        for dist in dists:
            for m in keys:
                c = by[(s, dist, m)]
                text = f"{c.rate():.2f}" + ("" if c.named == c.caught else f" ({c.named / c.trials:.2f})")
                row.append(("**" + text + "**" if c.rate() < GOAL else text) + ("" if c.clean_passes else " FA"))
        lines.append(f"| {s} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def allowance_table(cells: List[Cell], keys: Sequence[int], dists: Sequence[str]) -> str:
    """The median element's allowance over the typical error (what a 10× error must beat)."""
    by = {(c.stage, c.dist, c.keys): c for c in cells}
    stages = [s for s in PLANTED if any(c.stage == s for c in cells)]
    lines = ["| stage | " + " | ".join(f"{dist} {m}" for dist in dists for m in keys) + " |",
             "|" + "---|" * (1 + len(dists) * len(keys))]
    for s in stages:
        lines.append(f"| {s} | " + " | ".join(f"{by[(s, dist, m)].allowance_over_typical:.3g}"
                                             for dist in dists for m in keys) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", default="1024,8192,32768", help="key counts M, comma-separated")
    ap.add_argument("--rows", type=int, default=32, help="query rows N")
    ap.add_argument("--d", type=int, default=64, help="d_k = d_v")
    ap.add_argument("--trials", type=int, default=100, help="plants per stage × distribution × M")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "attnstep_catch_rate",
                    help="scratch folder [default: in the system's temporary folder]")
    ap.add_argument("--exact-energy-macs", type=int, help="an experiment, not the check as shipped: the head size "
                    "(multiply-adds) up to which the dot products' bounds take the exact partial sums (the "
                    "error model's cost cap) for this run")
    ap.add_argument("--json", type=Path, help="write every cell here")
    ap.add_argument("--markdown", type=Path, help="write the table here")
    args = ap.parse_args(argv)
    keys = [int(k) for k in args.keys.split(",")]
    if args.exact_energy_macs:
        dot.ENERGY_EXACT_MAX_MACS = args.exact_energy_macs
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cells = measure(find_binary(), args.work, keys, args.rows, args.d, args.trials, args.seed,
                    log=lambda line: print(line, file=sys.stderr, flush=True))
    table = markdown(cells, keys, DISTRIBUTIONS) + "\n\n" + allowance_table(cells, keys, DISTRIBUTIONS)
    print(table)
    settings = {"rows": args.rows, "d": args.d, "heads": 1, "causal": False, "trials": args.trials,
                "factor": FACTOR, "seed": args.seed, "typical_error": "RMS over the stage's finite elements of "
                "|run - float64 reference from the original inputs|", "backend": "cpu",
                "exact_energy_max_macs": dot.ENERGY_EXACT_MAX_MACS, "seconds": round(time.perf_counter() - t0, 1)}
    if args.json:
        args.json.write_text(json.dumps({"settings": settings, "cells": [c.to_json() for c in cells]}, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
