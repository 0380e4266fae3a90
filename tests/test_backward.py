"""The verifier on the backward pass: correct float32 backward programs (tests/helpers/foreign_routes.py: other
summation orders, dS by either route, the scale before or after the GEMM, exp or exp2 tiles of any
width) pass, and each classic backward bug fails with its name."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helpers import foreign_routes as foreign
from verify.check import compare
from verify.check.reference import reference_chain
from verify.diagnose.hypotheses import diagnose
from verify.files.case import write_toml
from verify.stages import (BACKWARD_STAGES, GRAD_INPUT, INPUT_MANIFEST, INPUT_NAMES, STAGE_NAMES, STAGES, Dims,
                           default_scale, stage_file)

SAMPLERS = {
    "normal": lambda rng, s: rng.standard_normal(s, dtype=np.float32),
    "uniform": lambda rng, s: rng.random(s, dtype=np.float32),
    "large": lambda rng, s: rng.standard_normal(s, dtype=np.float32) * np.float32(10),
}


def write_backward_case(tmp: Path, dims: Dims, causal: bool, dist: str = "normal", seed: int = 0,
                        route: foreign.BackwardRoute = foreign.BackwardRoute(), bug=None, writer: str = "npy",
                        only=None):
    """An input case with dO, and a foreign program's outputs (no run.toml) for it."""
    rng = np.random.default_rng(seed)
    in_dir = tmp / "in"
    in_dir.mkdir(parents=True)
    scale = default_scale(dims.d_k)
    heads = []
    for i in range(dims.total_heads):
        mats = {n: SAMPLERS[dist](rng, STAGES[n].shape(dims)) for n in INPUT_NAMES + (GRAD_INPUT,)}
        for n, x in mats.items():
            np.save(in_dir / stage_file(n, i, "npy"), x)
        head = foreign.compute_head(mats["Q"], mats["K"], mats["V"], scale, causal)
        foreign.compute_backward(head, mats[GRAD_INPUT], scale, causal, route, bug)
        heads.append(head)
    write_toml(in_dir / INPUT_MANIFEST, dict(batch=dims.batch, heads=dims.heads, seq_q=dims.seq_q,
                                             seq_k=dims.seq_k, d_k=dims.d_k, d_v=dims.d_v, causal=causal,
                                             format="npy"), "test case")
    foreign.write_outputs(tmp / "out", heads, dims, writer, only=STAGE_NAMES if only is None else only)
    return in_dir, tmp / "out"


def failures(report):
    return {(r.stage, r.head): r for r in report.results if r.status != "PASS"}


CORRECT = [  # (n, m, d, causal, dist, writer, route)
    (48, 48, 32, False, "normal", "npy", foreign.BackwardRoute()),
    (40, 24, 16, True, "uniform", "g9", foreign.BackwardRoute("reverse", "dist", "before", "exp2-16")),
    (24, 56, 32, True, "large", "npy_flat", foreign.BackwardRoute("splitk", "sub", "after", "exp-32")),
    (33, 33, 16, False, "uniform", "g6", foreign.BackwardRoute("pairwise", "dist", "after", "exp2-32")),
    (17, 40, 64, True, "normal", "mixed", foreign.BackwardRoute("f64", "sub", "before", "exp-16")),
    (64, 7, 32, False, "large", "f6", foreign.BackwardRoute("blas", "dist", "before", "exp2-64")),
    # A GPU's flash backward flushes subnormal weights and dS to zero: with large logits some
    # gradients are made only of such terms.
    (1, 288, 16, False, "large", "npy", foreign.BackwardRoute(flash="exp2-64", ftz=True)),
    (16, 107, 64, True, "large", "npy", foreign.BackwardRoute(flash="exp2-64", ftz=True)),
]


@pytest.mark.parametrize("n,m,d,causal,dist,writer,route", CORRECT,
                         ids=[f"{c[0]}x{c[1]}x{c[2]}-{'causal' if c[3] else 'full'}-{c[4]}-{c[5]}" for c in CORRECT])
def test_a_correct_backward_passes(tmp_path, n, m, d, causal, dist, writer, route):
    in_dir, out_dir = write_backward_case(tmp_path, Dims(1, 2, n, m, d, d), causal, dist, route=route,
                                          writer=writer)
    report = compare.check(in_dir, out_dir, diagnoser=diagnose)
    assert not failures(report), [(r.stage, r.head, r.message, [d.message for d in r.diagnosis])
                                  for r in failures(report).values()]
    assert set(BACKWARD_STAGES) <= set(report.run.stages)


@pytest.mark.parametrize("only", [BACKWARD_STAGES, ("flash_dQ", "flash_dK", "flash_dV")], ids=["backward", "flash"])
def test_a_backward_without_its_forward_files_is_checked_from_the_inputs(tmp_path, only):
    """A program that writes only its gradients: each is checked against the reference chain."""
    in_dir, out_dir = write_backward_case(tmp_path, Dims(1, 1, 32, 40, 16, 16), True, only=only)
    report = compare.check(in_dir, out_dir, diagnoser=diagnose)
    assert not failures(report)
    assert "attention_weights" not in report.run.stages


# bug -> (causal, the stages that must fail with the diagnosis, the diagnosis)
BUGS = {
    "D_wrong_O": (False, ("D", "flash_dQ", "flash_dK"), "D_wrong_O"),
    "dS_missing_P": (True, ("dS", "flash_dQ", "flash_dK"), "dS_missing_P"),
    "grad_unscaled": (True, ("dQ", "dK", "flash_dQ", "flash_dK"), "grad_unscaled"),
    "dV_untransposed_P": (False, ("dV", "flash_dV"), "dV_untransposed_P"),
    "bwd_mask": (True, ("flash_dQ", "flash_dK", "flash_dV"), "mask_missing"),
    "bwd_lse_log2": (False, ("flash_dQ", "flash_dK", "flash_dV"), "lse_log2"),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_a_backward_bug_fails_with_its_name(tmp_path, bug):
    causal, stages, code = BUGS[bug]
    in_dir, out_dir = write_backward_case(tmp_path, Dims(1, 2, 40, 40, 32, 32), causal, bug=bug)
    failed = failures(compare.check(in_dir, out_dir, diagnoser=diagnose))
    for stage in stages:
        for head in range(2):
            r = failed.get((stage, head))
            assert r is not None and r.status == "FAIL", (stage, head)
            assert r.diagnosis and r.diagnosis[0].code == code, (stage, head, [d.message for d in r.diagnosis])


def test_d_from_another_head_s_output_is_named_with_the_head_it_read(tmp_path):
    """D = rowsum(dO∘O) with the next head's O (the offset into O off by a head; the last head's
    wraps to the first): named D_wrong_O, with the head."""
    in_dir, out_dir = write_backward_case(tmp_path, Dims(1, 3, 48, 48, 32, 32), True, only=("output", "D"))
    dO = [np.load(in_dir / stage_file(GRAD_INPUT, h, "npy")) for h in range(3)]
    O = [np.load(out_dir / stage_file("output", h, "npy")) for h in range(3)]
    for h in range(3):
        D = (dO[h] * O[(h + 1) % 3]).sum(axis=1, keepdims=True, dtype=np.float32)
        np.save(out_dir / stage_file("D", h, "npy"), D)
    failed = failures(compare.check(in_dir, out_dir, diagnoser=diagnose))
    assert sorted(failed) == [("D", h) for h in range(3)], sorted(failed)
    for h in range(3):
        found = failed[("D", h)].diagnosis
        assert found and found[0].code == "D_wrong_O" and found[0].detail["read_head"] == (h + 1) % 3, \
            [d.message for d in found]
        assert f"the O of head {(h + 1) % 3}" in found[0].message


def _flash_backward_failures(tmp_path, dims: Dims, causal: bool, bug: str):
    """The failures of another program's flash backward with `bug` (%g text, its flash stages alone,
    no run.toml)."""
    flash = ("flash_output", "flash_lse", "flash_dQ", "flash_dK", "flash_dV")
    in_dir, out_dir = write_backward_case(tmp_path, dims, causal, bug=bug, writer="g9", only=flash)
    return failures(compare.check(in_dir, out_dir, diagnoser=diagnose))


@pytest.mark.parametrize("causal", [False, True])
def test_dq_accumulated_at_the_key_tiles_rows_is_named_with_its_tiles(tmp_path, causal):
    """Another program's flash backward (tiles of 64, %g text, its flash stages alone, no run.toml)
    that adds each tile's dQ term at the key tile's rows."""
    failed = _flash_backward_failures(tmp_path, Dims(1, 2, 160, 160, 32, 32), causal, "dq_key_rows")
    assert {s for s, _ in failed} == {"flash_dQ"}, sorted(failed)
    for head in range(2):
        found = failed[("flash_dQ", head)].diagnosis
        assert found and found[0].code == "dq_key_tile_rows" and [64, 64] == [found[0].detail["query_tile"],
                                                                             found[0].detail["key_tile"]], found


@pytest.mark.parametrize("causal", [False, True])
def test_dv_from_each_tile_of_p_untransposed_is_named_with_its_tile(tmp_path, causal):
    """Another program's flash backward (square tiles of 64, its flash stages alone, no run.toml)
    that adds P_tile·dO_tile to dV where P_tileᵀ·dO_tile belongs."""
    failed = _flash_backward_failures(tmp_path, Dims(1, 2, 128, 192, 32, 32), causal, "dV_untransposed_tile")
    assert {s for s, _ in failed} == {"flash_dV"}, sorted(failed)
    for head in range(2):
        found = failed[("flash_dV", head)].diagnosis
        assert found and found[0].code == "dV_untransposed_P" and found[0].detail["tile"] == 64, found


def test_stages_downstream_of_a_wrong_ds_inherit_it(tmp_path):
    in_dir, out_dir = write_backward_case(tmp_path, Dims(1, 1, 32, 32, 16, 16), False, bug="dS_missing_P")
    failed = failures(compare.check(in_dir, out_dir, diagnoser=diagnose))
    assert failed[("dS", 0)].status == "FAIL"
    assert failed[("dQ", 0)].status == "INHERITED"
    assert failed[("dK", 0)].status == "INHERITED"  # its column sums follow dS's rows: a note, not a failure
    assert any(v.code == "column_sum" for v in failed[("dK", 0)].notes)


def _rewrite(out_dir: Path, stage: str, head: int, change) -> None:
    path = out_dir / stage_file(stage, head, "npy")
    x = np.load(path)
    change(x)
    np.save(path, x)


def test_one_wrong_gradient_element_fails(tmp_path):
    in_dir, out_dir = write_backward_case(tmp_path, Dims(1, 1, 32, 32, 32, 32), False)

    def bump(x):
        x[5, 7] += np.float32(1e-3) * np.abs(x).max()
    for stage in ("dQ", "flash_dK", "flash_dV", "dS"):
        _rewrite(out_dir, stage, 0, bump)
    failed = failures(compare.check(in_dir, out_dir, diagnoser=diagnose))
    assert {s for s, _ in failed} == {"dQ", "flash_dK", "flash_dV", "dS"}


def test_ds_invariants_name_an_unmasked_entry_and_a_row_that_does_not_sum_to_zero(tmp_path):
    in_dir, out_dir = write_backward_case(tmp_path, Dims(1, 1, 24, 24, 16, 16), True)

    def unmask(x):
        x[2, 20] = np.float32(0.5)
    _rewrite(out_dir, "dS", 0, unmask)
    r = failures(compare.check(in_dir, out_dir, diagnoser=diagnose))[("dS", 0)]
    assert {"mask_missing", "row_sum"} <= {v.code for v in r.violations}


def test_flash_gradients_that_disagree_with_the_stage_path_are_named(tmp_path):
    in_dir, out_dir = write_backward_case(tmp_path, Dims(1, 1, 32, 32, 16, 16), False)

    def shift(x):
        x[:] = x + np.float32(1e-2) * np.abs(x).max()
    _rewrite(out_dir, "flash_dV", 0, shift)
    r = failures(compare.check(in_dir, out_dir, diagnoser=diagnose))[("flash_dV", 0)]
    assert any(v.code == "flash_vs_stages" for v in r.violations)


@pytest.mark.parametrize("causal", [False, True])
def test_the_flash_references_equal_the_stage_path_references(causal):
    rng = np.random.default_rng(3)
    inputs = {n: rng.standard_normal((20 if n in ("Q", "dO") else 28, 16)) for n in ("Q", "K", "V", "dO")}
    chain = reference_chain(inputs, 0.25, causal, [s for s in STAGES if not STAGES[s].split])
    for flash, stage in (("flash_dQ", "dQ"), ("flash_dK", "dK"), ("flash_dV", "dV")):
        np.testing.assert_allclose(chain[flash], chain[stage], rtol=1e-12, atol=1e-12)
    assert np.allclose(chain["dS"].sum(axis=1), 0.0, atol=1e-12)
    assert np.allclose(chain["dK"].sum(axis=0), 0.0, atol=1e-12)
    if causal:
        assert (chain["dS"][np.triu_indices(20, 1, 28)] == 0).all()


def test_finite_differences_agree_with_the_reference_gradients():
    """The references are the gradients of L = Σ dO∘attention(Q, K, V): checked against central
    differences of the float64 forward."""
    rng = np.random.default_rng(4)
    inputs = {n: rng.standard_normal((6 if n in ("Q", "dO") else 9, 4)) for n in ("Q", "K", "V", "dO")}
    scale, causal = 0.4, True
    chain = reference_chain(inputs, scale, causal, [s for s in STAGES if not STAGES[s].split])

    def loss(x):
        return float((reference_chain(x, scale, causal, ["output"])["output"] * inputs["dO"]).sum())
    h = 1e-6
    for name, grad in (("Q", "dQ"), ("K", "dK"), ("V", "dV")):
        num = np.zeros(inputs[name].shape)
        for idx in np.ndindex(num.shape):
            plus = {**inputs, name: inputs[name].copy()}
            minus = {**inputs, name: inputs[name].copy()}
            plus[name][idx] += h
            minus[name][idx] -= h
            num[idx] = (loss(plus) - loss(minus)) / (2 * h)
        np.testing.assert_allclose(chain[grad], num, rtol=1e-6, atol=1e-8)


def _api_heads(bug=None, causal=True):
    rng = np.random.default_rng(5)
    dims = Dims(1, 2, 24, 30, 16, 16)
    mats = {n: np.stack([SAMPLERS["normal"](rng, STAGES[n].shape(dims)) for _ in range(2)])
            for n in INPUT_NAMES + (GRAD_INPUT,)}
    heads = []
    for i in range(2):
        head = foreign.compute_head(mats["Q"][i], mats["K"][i], mats["V"][i], default_scale(16), causal)
        foreign.compute_backward(head, mats["dO"][i], default_scale(16), causal, bug=bug)
        heads.append(head)
    grads = {s: np.stack([h[s] for h in heads]) for s in ("dQ", "dK", "dV")}
    return mats, grads


def test_the_python_api_checks_gradients_given_do():
    import attnstep
    mats, grads = _api_heads()
    report = attnstep.check_arrays(mats["Q"], mats["K"], mats["V"], grads, do=mats["dO"], causal=True)
    assert report.passed, attnstep.format_report(report)
    mats, grads = _api_heads(bug="grad_unscaled")
    report = attnstep.check_arrays(mats["Q"], mats["K"], mats["V"], grads, do=mats["dO"], causal=True)
    assert not report.passed and report.first_failing_stage == "dQ"
    with pytest.raises(ValueError, match="pass do="):
        attnstep.check_arrays(mats["Q"], mats["K"], mats["V"], grads, causal=True)


def test_a_coarsely_printed_lse_does_not_hide_a_wrong_causal_gradient(tmp_path):
    """flash_lse printed with 3 decimals: its resolution moves the recomputed P only where the mask
    lets a key through (an unmasked P there would allow errors of 1e5 in the first rows)."""
    in_dir, out_dir = write_backward_case(tmp_path, Dims(1, 1, 64, 64, 16, 16), True)
    lse = np.load(out_dir / stage_file("flash_lse", 0, "npy"))
    (out_dir / stage_file("flash_lse", 0, "npy")).unlink()
    np.savetxt(out_dir / stage_file("flash_lse", 0, "txt"), lse.astype(np.float64), fmt="%.3f")

    def wrong_rows(x):
        x[1:4] *= np.float32(1.5)
    _rewrite(out_dir, "flash_dQ", 0, wrong_rows)
    r = compare.check(in_dir, out_dir, diagnoser=diagnose)
    bad = next(x for x in r.results if x.stage == "flash_dQ")
    assert bad.status == "FAIL"
    assert bad.isolated.mismatched >= 2 * 16 and bad.isolated.first[0]["row"] == 1, bad.isolated.first[:2]


def test_dk_columns_that_do_not_sum_to_zero_fail_though_every_entry_is_within_its_bound(tmp_path):
    """A small constant added down one column of dK: each entry stays within its chained bound, the
    column's sum does not (the sum's bound grows as √M, the shift as M). (For flash_dK of a program
    without run.toml the one-signed tensor-core allowance dominates and adds up as M too.)"""
    stage = "dK"
    from verify.check import tolerance
    in_dir, out_dir = write_backward_case(tmp_path, Dims(1, 1, 96, 96, 16, 16), False)
    inputs = {n: np.load(in_dir / stage_file(n, 0, "npy")) for n in INPUT_NAMES + (GRAD_INPUT,)}
    chain = reference_chain(inputs, default_scale(16), False, [s for s in STAGES if not STAGES[s].split])
    chain.update({n: x.astype(np.float64) for n, x in inputs.items()})
    shift = 0.9 * tolerance.chained_bound(stage, chain, scale=default_scale(16), causal=False)[:, 0].min()

    def shift_column(x):
        x[:, 0] += np.float32(shift)
    _rewrite(out_dir, stage, 0, shift_column)
    r = next(x for x in compare.check(in_dir, out_dir, diagnoser=diagnose).results if x.stage == stage)
    assert r.chained.passed and r.status == "FAIL"
    assert [v.code for v in r.violations] == ["column_sum"]


def test_backward_outputs_against_a_case_without_do_are_a_one_line_error(tmp_path):
    from click.testing import CliRunner
    from verify.cli.group import cli
    in_dir, out_dir = write_backward_case(tmp_path, Dims(1, 1, 16, 16, 16, 16), False)
    for f in in_dir.glob(f"{GRAD_INPUT}_head_*"):
        f.unlink()
    r = CliRunner().invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir)])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "holds the backward stage dO" in lines[0] and "has no dO" in lines[0], r.output


def test_the_python_api_leaves_the_callers_garbage_collector_as_it_was():
    """check_arrays runs in the caller's process: objects the caller froze stay frozen."""
    import gc

    import attnstep
    mats, grads = _api_heads()
    keep = [object() for _ in range(10)]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        attnstep.check_arrays(mats["Q"], mats["K"], mats["V"], grads, do=mats["dO"], causal=True)
        assert gc.get_freeze_count() > frozen // 2  # not unfrozen (a few frozen objects may die)
    finally:
        gc.unfreeze()
    del keep


# ---- a mask bug in a program that wrote its gradients alone ------------------------------------------

def _gradients_under(q, k, v, do, hidden):
    """dQ, dK, dV (B, H, ·, d) of attention under `hidden` (N×M, True hides), in float64, then float32:
    a program whose forward and backward both apply that mask, and write only the gradients."""
    scale = 1.0 / np.sqrt(q.shape[-1])
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    s = np.where(hidden, -np.inf, q @ np.swapaxes(k, -1, -2) * scale)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (do * (p @ v)).sum(-1, keepdims=True))
    return [np.asarray(x, np.float32) for x in (scale * ds @ k, scale * np.swapaxes(ds, -1, -2) @ q,
                                                 np.swapaxes(p, -1, -2) @ do)]


@pytest.mark.parametrize("names, bug, code", [
    (("dQ", "dK", "dV"), "top-left", "mask_offset"),
    (("flash_dQ", "flash_dK", "flash_dV"), "top-left", "mask_offset"),
    (("flash_dQ", "flash_dK", "flash_dV"), "window", "window_off"),
])
def test_a_mask_bug_is_named_where_the_program_wrote_its_gradients_alone(names, bug, code):
    """The case is causal bottom-right (N < M), with a window (16, 0) for the window bug; the program
    aligned its mask top-left, or let each row see one key more on the left, in both passes."""
    import attnstep
    rng = np.random.default_rng(5)
    N, M, d = 40, 64, 16
    q, do = (rng.standard_normal((1, 2, N, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, 2, M, d)).astype(np.float32) for _ in range(2))
    i, j = np.arange(N)[:, None], np.arange(M)[None, :]
    diag = i + M - N
    window = (16, 0) if bug == "window" else None
    right = (j > diag) | ((j < diag - 16) if window else False)
    wrong = (j > i) if bug == "top-left" else (j > diag) | (j < diag - 17)
    args = dict(do=do, causal="bottom-right", window=window)
    assert attnstep.check_arrays(q, k, v, dict(zip(names, _gradients_under(q, k, v, do, right))), **args)
    report = attnstep.check_arrays(q, k, v, dict(zip(names, _gradients_under(q, k, v, do, wrong))), **args)
    first = [r for r in report.results if r.stage == report.first_failing_stage and not r.passed]
    assert first and all(r.diagnosis and r.diagnosis[0].code == code for r in first), \
        attnstep.format_report(report)


def test_a_mask_bug_in_gradient_files_alone_is_named(tmp_path):
    """The same as another program's files: %g text under its own names, no run.toml, the gradients
    alone; its causal mask lets each row see one key past the diagonal in both passes."""
    from helpers.cli import invoke
    N = M = 48
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    assert invoke("generate", "--out", in_dir, "--heads", 2, "--seq-q", N, "--seq-k", M, "--d-k", 16, "--d-v", 16,
                  "--causal", "--backward").exit_code == 0
    load = lambda name, h: np.loadtxt(in_dir / stage_file(name, h, "txt"), ndmin=2).astype(np.float32)  # noqa: E731
    out_dir.mkdir()
    wrong = np.arange(M)[None, :] > np.arange(N)[:, None] + 1
    for h in range(2):
        q, k, v, do = (load(n, h)[None, None] for n in (*INPUT_NAMES, GRAD_INPUT))
        for name, g in zip(("dq", "dk", "dv"), _gradients_under(q, k, v, do, wrong)):
            np.savetxt(out_dir / f"{name}_{h}.txt", g[0, 0], fmt="%g")
    r = invoke("check", "--in", in_dir, "--out", out_dir, "--name", "flash_dQ=dq_{i}.txt",
               "--name", "flash_dK=dk_{i}.txt", "--name", "flash_dV=dv_{i}.txt")
    assert r.exit_code == 1 and "first failing stage: flash_dQ" in r.output, r.output
    assert "flash_dQ (both heads); mask_offset:" in r.output, r.output
