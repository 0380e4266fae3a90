"""A failing stage of a head too long to recompute whole (verify/check/slab.py): its causes are
looked for on a slab of the head's query rows (its first, or its last under a bottom-right mask
with N != M), checked as a case of their own, and named with those rows; its unwritten regions and
other patterns on the whole stage. The recomputing diagnoses never see more than the slab's rows.
DIAGNOSIS_SCORES is lowered so that a head of 256 × 256 scores is long (its slab: 64 rows); the
same bugs on the head diagnosed whole get the same names."""
from __future__ import annotations

import re

import numpy as np
import pytest

import attnstep
from helpers import foreign_routes as foreign
from verify.check import pool, sizing
from verify.diagnose import hypotheses

N, D, TILE, SLAB = 256, 32, 32, 64
SCALE = D ** -0.5
# The hypotheses that recompute a stage from Q, K, V (the others read got and want alone).
RECOMPUTING = ("scaled", "softmax_axis", "head_permuted", "mask", "keys", "overflow")


def _case(seed: int = 3, n: int = N, m: int = N):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((1, 2, rows, D)).astype(np.float32) for rows in (n, m, m))


def _flash(q, k, v, scale: float = SCALE, causal: bool = True, mask_offset: int = 0):
    """A float32 flash forward (tiles of 32 keys) of every head: output (B, H, N, d), lse (B, H, N)."""
    heads = [foreign.flash_forward(q[0, h], k[0, h], v[0, h], scale, causal, TILE, False, mask_offset)
             for h in range(q.shape[1])]
    return np.stack([o for o, _ in heads])[None], np.stack([lse[:, 0] for _, lse in heads])[None]


@pytest.fixture
def seen_rows(monkeypatch):
    """The rows of every stage a recomputing hypothesis was shown."""
    rows = []
    for name in RECOMPUTING:
        hyp = hypotheses._HYPOTHESES[name]

        def spy(stage, got, want, ctx, width, hyp=hyp):
            rows.append(got.shape[0])
            return hyp(stage, got, want, ctx, width)
        monkeypatch.setitem(hypotheses._HYPOTHESES, name, spy)
    return rows


@pytest.fixture
def long_heads(monkeypatch):
    monkeypatch.setattr(sizing, "DIAGNOSIS_SCORES", N * N // 4)


def _words(message: str) -> str:
    """A finding's message without its max diff (a slab's rows fit the candidate otherwise closely)."""
    return re.sub(r" \(max diff [^)]*\)", "", message)


def _named(report, stage: str):
    results = [r for r in report.results if r.stage == stage]
    assert results and all(r.status == "FAIL" for r in results), [(r.head, r.status) for r in results]
    return [r.diagnosis for r in results]


@pytest.mark.parametrize("bug, planted, code", [
    ("mask one key past the diagonal", dict(mask_offset=1), "mask_offset"),
    ("scale missing", dict(scale=1.0), "scaled"),
], ids=["mask_offset", "scaled"])
def test_a_long_heads_cause_is_named_from_its_first_rows(long_heads, seen_rows, bug, planted, code):
    q, k, v = _case()
    out, lse = _flash(q, k, v, **planted)
    report = attnstep.check_arrays(q, k, v, {"flash_output": out, "flash_lse": lse}, causal=True)
    assert report.first_failing_stage == "flash_output"
    for stage in ("flash_output", "flash_lse"):
        for found in _named(report, stage):
            assert found[0].code == code, [(d.code, d.message) for d in found]
            assert found[0].message.endswith(f"(found on query rows 0..{SLAB - 1} of {N})"), found[0].message
    assert seen_rows and max(seen_rows) == SLAB, seen_rows
    assert any("first 64 query rows" in n for n in report.run.notes), report.run.notes


@pytest.mark.parametrize("planted, code", [(dict(mask_offset=1), "mask_offset"), (dict(scale=1.0), "scaled")],
                         ids=["mask_offset", "scaled"])
def test_the_same_bugs_are_named_alike_on_a_head_diagnosed_whole(seen_rows, planted, code):
    q, k, v = _case()
    out, lse = _flash(q, k, v, **planted)
    report = attnstep.check_arrays(q, k, v, {"flash_output": out, "flash_lse": lse}, causal=True)
    for found in _named(report, "flash_output"):
        assert found[0].code == code and "found on query rows" not in found[0].message
    assert max(seen_rows) == N
    assert not any("too long" in n for n in report.run.notes)


def test_rows_left_unwritten_past_the_slab_are_placed_on_the_whole_stage(long_heads, seen_rows):
    q, k, v = _case()
    out, lse = _flash(q, k, v)
    out[0, 1, N - 6:] = 0.0  # the last query tile's last rows never written
    report = attnstep.check_arrays(q, k, v, {"flash_output": out, "flash_lse": lse}, causal=True)
    [found] = [r.diagnosis for r in report.results if r.stage == "flash_output" and r.head == 1]
    assert found[0].code == "unwritten" and f"rows {N - 6}..{N - 1}" in found[0].message, found
    assert all(r <= SLAB for r in seen_rows), seen_rows


def test_a_correct_long_head_passes_without_a_note(long_heads):
    q, k, v = _case()
    out, lse = _flash(q, k, v)
    report = attnstep.check_arrays(q, k, v, {"flash_output": out, "flash_lse": lse}, causal=True)
    assert report.passed, attnstep.format_report(report)
    assert not any("too long" in n for n in report.run.notes)


# (case's alignment, the program's mask offset in the whole head's rows, what the slab's finding says)
N_NOT_M = {
    "bottom-right, one key past": ("bottom-right", 1, "is shifted by +1"),
    "top-left, aligned bottom-right": ("top-left", "bottom-right", "bottom-right aligned (flash-attn's convention)"),
    "bottom-right, aligned top-left": ("bottom-right", "top-left", "top-left aligned (PyTorch's convention)"),
}


@pytest.mark.parametrize("name", N_NOT_M)
def test_a_head_with_more_keys_names_its_mask_from_rows_aligned_as_the_head(long_heads, seen_rows, monkeypatch, name):
    """With M > N, a bottom-right case's slab is the head's last rows (its first rows see M − N keys
    more than a case of their own), a top-left one's its first; an alignment is named by the whole
    head's N and M, as on the head diagnosed whole."""
    align, planted, words = N_NOT_M[name]
    n, m = N // 2, 2 * N
    rows = N * N // 4 // m
    q, k, v = _case(n=n, m=m)
    offsets = {"top-left": 0, "bottom-right": m - n}
    offset = offsets[planted] if isinstance(planted, str) else offsets[align] + planted
    out, lse = _flash(q, k, v, mask_offset=offset)
    report = attnstep.check_arrays(q, k, v, {"flash_output": out, "flash_lse": lse}, causal=align)
    first = n - rows if align == "bottom-right" else 0
    where = f" (found on query rows {first}..{first + rows - 1} of {n})"
    long = _named(report, "flash_output")
    for found in long:
        assert found[0].code == "mask_offset" and words in found[0].message, [d.message for d in found]
        assert found[0].message.endswith(where), found[0].message
    assert max(seen_rows) == rows, seen_rows
    which = "last" if first else "first"
    assert any(f"{which} {rows} query rows" in note for note in report.run.notes), report.run.notes
    monkeypatch.setattr(sizing, "DIAGNOSIS_SCORES", n * m)  # the same head diagnosed whole
    whole = attnstep.check_arrays(q, k, v, {"flash_output": out, "flash_lse": lse}, causal=align)
    assert [_words(f[0].message) + where for f in _named(whole, "flash_output")] == [_words(f[0].message) for f in long]


def test_a_bottom_right_heads_missing_scale_is_named_from_its_last_rows(long_heads):
    n, m = N // 2, 2 * N
    q, k, v = _case(n=n, m=m)
    out, lse = _flash(q, k, v, scale=1.0, mask_offset=m - n)
    report = attnstep.check_arrays(q, k, v, {"flash_output": out, "flash_lse": lse}, causal="bottom-right")
    for stage in ("flash_output", "flash_lse"):
        for found in _named(report, stage):
            assert found[0].code == "scaled" and found[0].message.endswith(f"(found on query rows 96..127 of {n})"), \
                [d.message for d in found]


def test_a_long_heads_dk_missing_its_scale_is_named_by_its_factor(long_heads):
    """dK and dV sum over every query row, so they have no slab: a constant factor, which needs no
    recomputation, is still found on the whole stage."""
    q, k, v = _case()
    do = np.random.default_rng(9).standard_normal(q.shape).astype(np.float32)
    out, lse = _flash(q, k, v, causal=False)
    dk = []
    for h in range(q.shape[1]):
        Q, K, V, dO = (x[0, h].astype(np.float64) for x in (q, k, v, do))
        P = np.exp(Q @ K.T * SCALE - lse[0, h][:, None])
        dP = dO @ V.T
        dS = P * (dP - (dO * out[0, h]).sum(axis=1, keepdims=True))
        dk.append(dS.T @ Q)  # (the scale left out)
    report = attnstep.check_arrays(q, k, v, {"flash_output": out, "flash_lse": lse, "flash_dK": np.stack(dk)[None]},
                                   do=do)
    for found in _named(report, "flash_dK"):
        assert found[0].code == "scaled" and "scale missing" in found[0].message, [(d.code, d.message) for d in found]
    assert any("dK and dV" in n for n in report.run.notes), report.run.notes


def test_a_long_head_of_another_programs_text_files_is_diagnosed_on_its_first_rows(long_heads, tmp_path):
    """A program of its own: %g text, no run.toml, the flash forward alone, its mask one key late."""
    from helpers.cli import check_folder, generate_input
    from verify.stages import Dims
    dims = Dims(1, 2, N, N, D, D)
    in_dir = generate_input(tmp_path / "in", dims, "normal", 7, True)
    heads = [dict(zip(("flash_output", "flash_lse"), foreign.flash_forward(x["Q"], x["K"], x["V"], SCALE, True, TILE,
                                                                          False, 1)))
             for x in foreign.read_inputs(in_dir, dims.total_heads)]
    foreign.write_outputs(tmp_path / "out", heads, dims, "g6", only=("flash_output", "flash_lse"))
    result, report = check_folder(tmp_path, in_dir, tmp_path / "out", True, None)
    assert report["first_failing_stage"] == "flash_output", result.output
    for e in report["results"]:
        assert e["diagnosis"][0]["code"] == "mask_offset", e["diagnosis"]
        assert e["diagnosis"][0]["message"].endswith(f"(found on query rows 0..{SLAB - 1} of {N})")


def test_a_mask_file_of_ones_read_inverted_is_no_explanation_of_an_empty_output():
    """A padding mask with no padding (all True): an output never written is `unwritten`, not the
    file read inverted, which would hide every key."""
    q, k, v = _case()
    out = np.zeros_like(q)
    report = attnstep.check_arrays(q, k, v, {"flash_output": out}, attn_mask=np.ones((N, N), bool))
    for found in _named(report, "flash_output"):
        assert found[0].code == "unwritten" and "mask_file_inverted" not in [d.code for d in found], found


def test_sequences_of_a_packed_run_are_diagnosed_whole_without_a_note(long_heads):
    """Each sequence of a packed run is a case of its own: diagnosed whole, as before, and the
    packed total is no head too long."""
    rng = np.random.default_rng(11)
    total = 2 * N
    q, k, v = (rng.standard_normal((total, 2, D)).astype(np.float32) for _ in range(3))
    outs, lses = [], []
    for s in range(2):
        rows = slice(s * N, (s + 1) * N)
        heads = [foreign.flash_forward(q[rows, h], k[rows, h], v[rows, h], SCALE, True, TILE, False, 1)
                 for h in range(2)]
        outs.append(np.stack([o for o, _ in heads], axis=1))
        lses.append(np.stack([x[:, 0] for _, x in heads]))
    cu = np.array([0, N, total])
    report = attnstep.check_arrays(q, k, v, {"flash_output": np.concatenate(outs), "flash_lse": np.concatenate(lses, 1)},
                                   causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    failing = [r for r in report.results if r.status == "FAIL" and r.stage == "flash_output"]
    assert failing and all(r.diagnosis[0].code == "mask_offset" and "found on query rows" not in r.diagnosis[0].message
                           for r in failing), [[d.code + ": " + d.message for d in r.diagnosis] for r in failing]
    assert not any("too long" in n for n in report.run.notes), report.run.notes


def test_slabs_wait_for_a_slot_where_memory_has_room_for_fewer_than_the_workers(monkeypatch):
    """Workers are sized by their tiled heads; a failing head's slab holds a dense check besides,
    so where what the workers leave holds one slab, one is checked at a time."""
    import multiprocessing
    import time
    monkeypatch.setattr(pool, "slab_bytes", lambda run: 10)
    monkeypatch.setattr(pool, "_workers", lambda *a: (4, 1, 4 * 1 + 10 + 9))  # four workers of 1 byte, room for one slab
    jobs = pool.head_jobs(None)
    assert (jobs, pool._SLABS_AT_ONCE) == (4, 1)
    inside, most, lock = multiprocessing.Value("i", 0), multiprocessing.Value("i", 0), multiprocessing.Lock()

    def check(job):
        with pool.slab_slot():
            with lock:
                inside.value += 1
                most.value = max(most.value, inside.value)
            time.sleep(0.2)
            with lock:
                inside.value -= 1
        return [job]
    assert pool.map_heads(check, 8, jobs) == list(range(8))
    assert most.value == 1 and pool._SLABS_AT_ONCE is None



def test_rows_that_see_no_key_are_not_a_running_maximum_started_at_zero():
    """A padding mask's rows that hide every key, written NaN (0/0): named as such, not as rows whose
    scores underflowed (they have no scores)."""
    q, k, v = _case()
    keep = np.ones((N, N), bool)
    keep[40:44] = False
    out, lse = _flash(q, k, v, causal=False)
    out[:, :, 40:44] = np.nan
    report = attnstep.check_arrays(q, k, v, {"flash_output": out}, attn_mask=keep)
    for found in _named(report, "flash_output"):
        assert "running_max_zero" not in [d.code for d in found] and found[0].code == "empty_rows_nan", \
            [(d.code, d.message) for d in found]


def test_a_slab_that_cannot_tell_no_mask_from_the_other_alignment_says_both(long_heads, monkeypatch):
    """N > M aligned bottom-right: under a top-left mask the last rows see every key, as with no
    mask at all; the slab's finding says both, where the head diagnosed whole names the alignment."""
    n, m = 2 * N, N // 2  # (a slab of the last 128 rows, each seeing every key under a top-left mask)
    q, k, v = _case(n=n, m=m)
    with np.errstate(invalid="ignore"):
        out, lse = _flash(q, k, v, mask_offset=0)  # top-left
    report = attnstep.check_arrays(q, k, v, {"flash_output": out, "flash_lse": lse}, causal="bottom-right")
    for found in _named(report, "flash_output"):
        assert found[0].code == "mask_missing" and "or with it top-left aligned (PyTorch's convention)" in \
            found[0].message, [d.message for d in found]


def test_one_query_row_aligned_bottom_right_under_a_top_left_mask_says_both():
    """A decode step's one query row checked as top-left causal, computed bottom-right: that row sees
    every key, as with no mask at all; the finding says both (as a slab's rows do)."""
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((1, 1, 32)), rng.standard_normal((1, 40, 32)), rng.standard_normal((1, 40, 32))
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    s = (q[0] @ k[0].T) / np.sqrt(32)
    p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    out = (p @ v[0]).astype(np.float32)[None]
    report = attnstep.check_arrays(q, k, v, {"flash_output": out}, causal="top-left")
    found = _named(report, "flash_output")
    assert found and all(d[0].code == "mask_missing" and "or with it bottom-right aligned (flash-attn's convention)"
                         in d[0].message for d in found), [[x.message for x in d] for d in found]
