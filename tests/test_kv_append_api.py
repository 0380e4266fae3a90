"""A decode step with new keys checked two ways agrees: a folder (`attnstep check` of the NumPy
program's files, tests/helpers/kv_append_programs.py) and the same arrays in flash-attn's layouts
through `attnstep.check_kvcache` (k_new, v_new, k_cache_after, v_cache_after). Both pass the right
step, fail a buggy one on the same sequences with the same first diagnosis, and name the same ways
the cache after the step went wrong."""
from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest

from helpers.cli import invoke
from helpers.kv_append_programs import run_program
import attnstep
from verify.check.compare import check
from verify.diagnose.hypotheses import diagnose

HEADS, KV_HEADS, D, NQ, NEW, P = 4, 2, 16, 2, 2, 4


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("kv_append") / "case"
    r = invoke("generate", "--out", folder, "--heads", HEADS, "--kv-heads", KV_HEADS, "--d-k", D, "--d-v", D,
               "--seqlens", "2,2,2", "--seqlens-k", "9,4,7", "--page-size", P, "--new-keys", NEW, "--causal",
               "--align", "bottom-right")
    assert r.exit_code == 0, r.output
    return folder


def _load(folder: Path, name: str, heads: int) -> np.ndarray:
    """(rows, heads, d): a per-head stage or input stacked along a heads axis."""
    return np.stack([np.loadtxt(folder / f"{name}_head_{h}.txt", dtype=np.float32, ndmin=2) for h in range(heads)],
                    axis=1)


def _api_report(case: Path, out: Path):
    """check_kvcache on the folder's arrays, in flash-attn's layouts."""
    B = tomllib.loads((case / "manifest.toml").read_text())["sequences"]
    pool = lambda x: x.reshape(-1, P, KV_HEADS, D)  # noqa: E731  (pool rows -> pages)
    new = lambda x: x.reshape(B, NEW, KV_HEADS, D)  # noqa: E731
    stages = {"output": _load(out, "output", HEADS).reshape(B, NQ, HEADS, D),
              "flash_lse": _load(out, "flash_lse", HEADS)[:, :, 0].reshape(B, NQ, HEADS).transpose(0, 2, 1)}
    return attnstep.check_kvcache(
        _load(case, "Q", HEADS).reshape(B, NQ, HEADS, D), pool(_load(case, "K", KV_HEADS)),
        pool(_load(case, "V", KV_HEADS)), stages, causal=True,
        cache_seqlens=np.loadtxt(case / "seqused_k.txt", dtype=np.int32),
        block_table=np.loadtxt(case / "block_table.txt", dtype=np.int32, ndmin=2),
        k_new=new(_load(case, "K_new", KV_HEADS)), v_new=new(_load(case, "V_new", KV_HEADS)),
        k_cache_after=pool(_load(out, "K", KV_HEADS)), v_cache_after=pool(_load(out, "V", KV_HEADS)))


def _firsts(report, stage: str) -> dict:
    """sequence -> the first diagnosis code of `stage`'s first failing result (None: none)."""
    out = {}
    for r in report.results:
        if r.stage == stage and r.status == "FAIL":
            out.setdefault(r.sequence, r.diagnosis[0].code if r.diagnosis else None)
    return out


@pytest.mark.parametrize("bug", [None, "one_late", "unseen", "not_written", "stale"])
def test_the_folder_and_the_api_agree(case, tmp_path, bug):
    out = run_program(case, tmp_path / "out", bug, stages=("output", "flash_lse", "K", "V"))
    folder = check(case, out, diagnoser=diagnose)
    api = _api_report(case, out)
    assert bool(folder) == bool(api) == (bug is None), (attnstep.format_report(api))
    for stage in ("output", "flash_lse"):
        assert _firsts(folder, stage) == _firsts(api, stage), stage
    cache = {c.stage: c for c in api.run_checks}
    for stage in ("K", "V"):
        named = {d.code for r in folder.results if r.stage == stage and r.status == "FAIL" for d in r.diagnosis
                 if d.code.startswith("cache_")}
        assert cache[stage].passed == (not named) == (bug in (None, "unseen", "stale"))
        assert {d["code"] for d in cache[stage].detail.get("diagnosis", [])} == named
