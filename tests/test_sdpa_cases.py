"""PyTorch's own attention as output cases: every SDPA backend must pass, planted bugs fail; and
what SDPA and FlexAttention are given for a variant case, checked without torch.

PyTorch's SDPA backends (flash, memory-efficient, cuDNN, math) are independent, correct
half-precision implementations; verify/bench/sdpa_outputs.py (its command: verify/cli/sdpa_outputs.py)
runs one of them on a generated case (inputs rounded to the format as the verifier rounds them, the
case's scale and variant, the gradients from its dO) and writes the results as another program's
`<stage>.npy` files; verify/bench/flex_outputs.py does the same with FlexAttention. On a GPU each
backend × format × shape must pass `attnstep check --precision` at every stage (forward and
backward), and a perturbed gradient or the wrong scale must fail; tests/test_gpu_cross_checks.py
does the same for every variant. A backend torch cannot run here (a cuDNN too old, a shape the
flash kernel refuses) is skipped with torch's reason.

Without torch or a GPU the same path runs with NumPy stand-ins (float64 attention of what SDPA or
Flex is given, results rounded to the format): the inputs, the masks and score_mods built from the
variant (against verify/variant.py), the stage names, the files and the check.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from helpers.planted_variants import (ALIBI_REVERSED, DK_ONE_HEAD, OTHER_ALIGNMENT, PLANTS, SDPA_CANNOT,
                                      SOFTCAP_LEFT_OUT, WINDOW_OFF_BY_ONE, assert_fails_where_it_starts, one_head_dk)
from verify.bench.flex_outputs import (BIAS, KEEP, KV_DOC, Q_DOC, SLOPES, document_ids, flex_arrays, mask_mod_of,
                                       score_mod_of, write_flex_case)
from verify.bench.foreign_outputs import (BackendUnavailable, CaseTensors, Results, case_inputs, case_tensors,
                                          in_format, stage_arrays, write_stage_files)
from verify.bench.sdpa_outputs import BACKENDS, EXPLICIT, attention_mask, sdpa_call, write_sdpa_case
from verify.cli import sdpa_outputs as sdpa_command
from verify.cli.group import cli
from verify.files.case import InputCase, load_input_case
from verify.files.generate import generate_case
from verify.model.half import round_to_format
from verify.stages import FLASH_GRAD_KEYS, GRAD_INPUT, HALF_PRECISIONS, INPUT_NAMES, STAGES, Dims
from verify.variant import BOTTOM_RIGHT, BROADCAST, PER_HEAD, Variant, alibi_slopes, hidden, modified_scores

f64 = np.float64

# (dims, causal): d 64 and 128, N = M and not (either longer), causal and not, several heads.
SHAPES = [
    pytest.param(Dims(1, 3, 128, 128, 64, 64), False, id="heads3-N128-M128-d64"),
    pytest.param(Dims(1, 2, 256, 256, 128, 128), True, id="heads2-N256-M256-d128-causal"),
    pytest.param(Dims(2, 2, 100, 257, 64, 64), True, id="batch2-heads2-N100-M257-d64-causal"),
    pytest.param(Dims(1, 2, 200, 77, 128, 128), True, id="heads2-N200-M77-d128-causal"),
    pytest.param(Dims(1, 4, 96, 160, 128, 128), False, id="heads4-N96-M160-d128"),
]
CONTROL = (Dims(1, 2, 128, 128, 64, 64), True)


def _case(tmp_path, dims, causal, seed=11, distribution="normal"):
    return generate_case(tmp_path / "in", dims, causal=causal, seed=seed, distribution=distribution,
                         backward=True, fmt="npy")


def _check(in_dir, out_dir, precision, tmp_path, *extra):
    """`attnstep check --precision`: (exit code, the JSON report)."""
    report = tmp_path / "report.json"
    r = CliRunner().invoke(cli, ["check", "--in", str(in_dir), "--out", str(out_dir), "--precision", precision,
                                 "--quiet", "--json", str(report), *extra], catch_exceptions=False)
    assert report.exists(), r.output
    return r.exit_code, json.loads(report.read_text())


def _failures(report) -> list:
    return [(r["stage"], r["head"], r["status"]) for r in report["results"] if not r["passed"]]


def _perturb(out_dir, stage, precision):
    """One element of the last head moved by half the head's largest magnitude and a tenth of its
    own (dozens of half ulps: the stage path's gradients at bf16, checked from the inputs alone,
    allow a fifth of the largest magnitude at places): a value no correct kernel writes."""
    path = out_dir / f"{stage}.npy"
    x = np.load(path)
    head = x.reshape((-1,) + x.shape[-2:])[-1]  # the last head (a view)
    head[3, 5] += np.sign(head[3, 5] or 1) * (0.1 * np.abs(head[3, 5]) + 0.5 * np.abs(head).max())
    np.save(path, x)


# ---- NumPy stand-ins for SDPA and Flex: the same files and checks, no torch --------------------

def _attention(inputs, scale, modify, precision) -> Results:
    """float64 attention of the (rounded) inputs, K and V repeated over each group, the results
    rounded to the format once (a correct program, more accurate than any kernel). modify(s) ->
    (the scores the softmax reads, their derivative by s) of the scaled scores s (B, H, N, M)."""
    q, k, v = (inputs[n].astype(f64) for n in INPUT_NAMES)
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s, slope = modify(scale * q @ np.swapaxes(k, -1, -2))
    top = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(top), top, 0))
    total = e.sum(axis=-1, keepdims=True)
    p = np.divide(e, total, out=np.zeros_like(e), where=total > 0)  # a row that sees no key: 0
    with np.errstate(divide="ignore"):
        lse = (np.log(total) + np.where(np.isfinite(top), top, 0))[..., 0].astype(np.float32)
    half = lambda x: in_format(x.astype(np.float32), precision)  # noqa: E731
    out = p @ v
    results = Results(half(out), lse)
    if GRAD_INPUT in inputs:
        do = inputs[GRAD_INPUT].astype(f64)
        ds = p * (do @ np.swapaxes(v, -1, -2) - (do * out).sum(axis=-1, keepdims=True)) * slope
        summed = lambda x: x.reshape(x.shape[0], -1, group, *x.shape[2:]).sum(axis=2)  # noqa: E731
        results.grads = {"dq": half(scale * ds @ k), "dk": half(summed(scale * np.swapaxes(ds, -1, -2) @ q)),
                         "dv": half(summed(np.swapaxes(p, -1, -2) @ do))}
    return results


def numpy_sdpa(call, backend, precision):
    """What SDPA computes from the call (is_causal top-left, the flash operator's bottom-right flag,
    a boolean or float attn_mask)."""
    def modify(s):
        n, m = s.shape[-2:]
        i, j = np.arange(n)[:, None], np.arange(m)[None, :]
        if call.is_causal or call.bottom_right:
            s = np.where(j <= i + (m - n if call.bottom_right else 0), s, -np.inf)
        if call.attn_mask is not None:
            s = np.where(call.attn_mask, s, -np.inf) if call.attn_mask.dtype == bool else s + call.attn_mask
        return s, 1.0

    results = _attention(call.inputs, call.scale, modify, precision)
    if not BACKENDS[backend].fused:
        results.lse = None
    return results


def _grids(t):
    """Flex's b, h, q_idx, kv_idx as NumPy index grids broadcasting to (B, H, N, M)."""
    return np.ix_(*(np.arange(x) for x in t.shape))


def numpy_flex(t, precision):
    """Flex's attention with the score_mod and mask_mod it is given, evaluated by NumPy."""
    arrays = flex_arrays(t)
    score_mod, mask_mod = score_mod_of(t, arrays, np), mask_mod_of(t, arrays)

    def modify(s):
        grid = _grids(t)
        cap = t.variant.softcap
        slope = 1 - np.tanh(s / cap) ** 2 if cap > 0 else 1.0
        s = score_mod(s, *grid) if score_mod else s
        return (np.where(mask_mod(*grid), s, -np.inf) if mask_mod else s), slope

    return _attention(t.inputs, t.scale, modify, precision)


@pytest.mark.parametrize("precision", HALF_PRECISIONS)
@pytest.mark.parametrize("backend", ["flash", "math"])
def test_sdpa_files_of_a_correct_program_pass_and_a_perturbed_one_fails(tmp_path, backend, precision):
    """The path the GPU tests take, with the NumPy stand-in: the fused backends' names (flash
    stages with the lse) and the math backend's (the stage path's), every stage passes; one
    perturbed gradient element fails at that stage, and so does the wrong scale."""
    dims = Dims(2, 1, 40, 56, 64, 64)
    in_dir = _case(tmp_path, dims, True)
    out_dir = tmp_path / "out"
    results = write_sdpa_case(in_dir, out_dir, backend, precision, runner=numpy_sdpa)
    written = stage_arrays(results, BACKENDS[backend].fused)
    assert all(STAGES[s].flash == BACKENDS[backend].fused for s in written)
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(f"{s}.npy" for s in written)
    if precision == "fp16":
        assert {np.load(out_dir / f"{s}.npy").dtype.str for s in written if not STAGES[s].float32} == {"<f2"}
    code, report = _check(in_dir, out_dir, precision, tmp_path)
    assert code == 0 and report["passed"] and report["precision"] == precision, _failures(report)
    assert {r["stage"] for r in report["results"]} == set(written)

    dk = [s for s in written if STAGES[s].rows == "M" and STAGES[s].cols == "DK"][0]
    _perturb(out_dir, dk, precision)
    code, report = _check(in_dir, out_dir, precision, tmp_path)
    assert code == 1 and report["first_failing_stage"] == dk, _failures(report)
    assert _failures(report) == [(dk, dims.total_heads - 1, "FAIL")]

    write_sdpa_case(in_dir, out_dir, backend, precision, scale=1.25 * dims.d_k ** -0.5, runner=numpy_sdpa)
    code, report = _check(in_dir, out_dir, precision, tmp_path)
    assert code == 1 and report["first_failing_stage"] == next(iter(written)), _failures(report)


def test_the_sdpa_inputs_are_the_verifiers_rounding(tmp_path):
    """What SDPA is given is Q, K, V, dO rounded as the verifier rounds them (nearest even)."""
    dims = Dims(1, 2, 9, 11, 16, 16)
    in_dir = _case(tmp_path, dims, False, distribution="large")
    seen = {}

    def spy(call, *args):
        seen.update(call.inputs)
        return numpy_sdpa(call, *args)

    write_sdpa_case(in_dir, tmp_path / "out", "efficient", "bf16", runner=spy)
    q1 = np.load(in_dir / "Q_head_1.npy")
    assert seen["Q"].shape == (1, 2, 9, 16) and seen[GRAD_INPUT].shape == (1, 2, 9, 16)
    np.testing.assert_array_equal(seen["Q"][0, 1], round_to_format(q1, "bf16").astype(np.float32))
    assert not np.array_equal(seen["Q"][0, 1], q1)


def test_grouped_inputs_keep_their_kv_heads_and_fp32_is_not_rounded():
    """K and V of a GQA case come with their Hk heads (b·Hk + g), Q with H; fp32 values as they are."""
    dims = Dims(2, 6, 5, 7, 4, 4, kv_heads=2)
    rng = np.random.default_rng(0)
    arrays = {"Q": rng.standard_normal((12, 5, 4)), "K": rng.standard_normal((4, 7, 4)),
              "V": rng.standard_normal((4, 7, 4))}
    got = case_inputs(InputCase(Path("."), dims, "npy", arrays=arrays), "fp32")
    assert got["Q"].shape == (2, 6, 5, 4) and got["K"].shape == (2, 2, 7, 4)
    np.testing.assert_array_equal(got["K"][1, 0], arrays["K"][2].astype(np.float32))
    np.testing.assert_array_equal(got["Q"][1, 5], arrays["Q"][11].astype(np.float32))


def test_the_sdpa_command_says_why_a_backend_cannot_run(tmp_path, monkeypatch):
    """Without torch (or a GPU) the command is one line and exit 1, not a traceback."""
    import verify.bench.sdpa_outputs as mod

    def unavailable(*args):
        raise BackendUnavailable("PyTorch is not installed")

    monkeypatch.setattr(mod, "run_sdpa", unavailable)
    in_dir = _case(tmp_path, Dims(1, 1, 8, 8, 16, 16), False)
    r = CliRunner().invoke(sdpa_command.main,
                           ["--in", str(in_dir), "--out", str(tmp_path / "out"), "--backend", "flash"])
    assert r.exit_code == 1 and r.output.strip() == "Error: SDPA backend unavailable: PyTorch is not installed", \
        r.output


def test_the_command_runs_flex_and_refuses_fp32_sdpa(tmp_path, monkeypatch):
    """--backend flex writes Flex's flash stages (fp32 too); SDPA at fp32 is a usage error."""
    import verify.bench.flex_outputs as flex_mod

    monkeypatch.setattr(flex_mod, "run_flex", numpy_flex)
    in_dir = _case(tmp_path, Dims(1, 2, 8, 12, 16, 16), True)
    r = CliRunner().invoke(sdpa_command.main, ["--in", str(in_dir), "--out", str(tmp_path / "out"),
                                               "--backend", "flex", "--precision", "fp32"])
    assert r.exit_code == 0 and "FlexAttention fp32: wrote flash_output, flash_lse" in r.output, r.output
    r = CliRunner().invoke(sdpa_command.main, ["--in", str(in_dir), "--out", str(tmp_path / "out"),
                                               "--backend", "math", "--precision", "fp32"])
    assert r.exit_code == 2 and "--precision fp32" in r.output and "Traceback" not in r.output, r.output


def test_a_refused_backend_is_skipped_with_torchs_own_reason():
    """torch refuses a forced backend with a warning per backend and "No available kernel": the
    reason kept is the one that says why, without where in torch it was raised."""
    import warnings

    from verify.bench.sdpa_outputs import _refused

    def refuse():
        where = " (Triggered internally at /pytorch/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:457.)"
        for message in ("Memory efficient kernel not used because:", "cuDNN attention has been runtime disabled.",
                        "Flash attention does not support the is_causal flag when seqlen_q != seqlen_k."):
            warnings.warn(message + where)
        raise RuntimeError("No available kernel. Aborting execution.")

    with pytest.raises(BackendUnavailable) as info:
        _refused(refuse, "flash")
    assert str(info.value) == ("flash: Flash attention does not support the is_causal flag when seqlen_q != "
                               "seqlen_k.")


# ---- what SDPA and Flex are given for a variant case (no files) ---------------------------------

def _tensors(dims, variant=Variant(), mask=None, bias=None, slopes=None, seed=3):
    """A case's tensors built directly: Q, dO with H heads, K, V with dims.kv."""
    rng = np.random.default_rng(seed)
    b, n, m, d = dims.batch, dims.seq_q, dims.seq_k, dims.d_k
    inputs = {"Q": rng.standard_normal((b, dims.heads, n, d)), "K": rng.standard_normal((b, dims.kv, m, d)),
              "V": rng.standard_normal((b, dims.kv, m, d)), GRAD_INPUT: rng.standard_normal((b, dims.heads, n, d))}
    if variant.alibi and slopes is None:
        slopes = np.tile(alibi_slopes(dims.heads), (b, 1))
    return CaseTensors(dims, {k: x.astype(np.float32) for k, x in inputs.items()}, d ** -0.5, variant, mask, bias,
                       slopes)


def _reference_scores(t):
    """verify.variant's scores the softmax reads, head by head, −inf where hidden: (B, H, N, M)."""
    b_, h_, n, m = t.shape
    zeros = np.zeros((n, m))
    out = np.empty(t.shape)
    for b in range(b_):
        for h in range(h_):
            mask = None if t.mask is None else np.broadcast_to(t.mask, t.shape)[b, h]
            bias = None if t.bias is None else np.broadcast_to(t.bias, t.shape)[b, h]
            slope = t.slopes[b, h] if t.variant.alibi else 0.0
            out[b, h] = np.where(hidden(t.variant, n, m, mask), -np.inf,
                                 modified_scores(zeros, t.variant, slope, bias))
    return out


def test_a_causal_mask_alone_is_each_backends_own_flag():
    """Top-left (or N = M): torch's is_causal; bottom-right with N != M: the flash operator's own
    flag, an explicit boolean mask on the other backends (said in a note); --mask explicit: the
    mask always. Query i sees keys j <= i + M - N bottom-right."""
    dims = Dims(1, 2, 5, 8, 16, 16)
    top, bottom = Variant(causal=True), Variant(causal=True, align=BOTTOM_RIGHT)
    assert sdpa_call(_tensors(dims, top), "flash", "bf16").is_causal
    assert sdpa_call(_tensors(Dims(1, 2, 6, 6, 16, 16), bottom), "cudnn", "bf16").is_causal
    call = sdpa_call(_tensors(dims, bottom), "flash", "bf16")
    assert call.bottom_right and call.attn_mask is None and not call.is_causal
    call = sdpa_call(_tensors(dims, bottom), "efficient", "bf16")
    want = np.arange(8)[None, :] <= np.arange(5)[:, None] + 3
    assert call.attn_mask.dtype == bool and np.array_equal(call.attn_mask[0, 0], want) and call.notes
    call = sdpa_call(_tensors(dims, top), "math", "bf16", EXPLICIT)
    assert not call.is_causal and np.array_equal(call.attn_mask[0, 0], np.tril(np.ones((5, 8), bool)))


VARIANT_MASKS = [
    pytest.param(Variant(window=(2, 1)), None, id="window-2-1"),
    pytest.param(Variant(causal=True, align=BOTTOM_RIGHT, window=(3, 0)), None, id="bottom-right-window-3-0"),
    pytest.param(Variant(mask=PER_HEAD), "per-head", id="mask-per-head"),
    pytest.param(Variant(causal=True, mask=BROADCAST), "broadcast", id="causal-mask-broadcast"),
    pytest.param(Variant(alibi=True, causal=True, align=BOTTOM_RIGHT), None, id="alibi-bottom-right-causal"),
    pytest.param(Variant(bias=PER_HEAD, window=(4, 4)), None, id="bias-window"),
    pytest.param(Variant(alibi=True, bias=BROADCAST, mask=PER_HEAD), "per-head", id="alibi-bias-mask"),
]


def _variant_tensors(variant, mask_cover, dims=Dims(2, 4, 7, 11, 16, 16, kv_heads=2)):
    rng = np.random.default_rng(5)
    lead = (dims.batch, dims.heads) if mask_cover == "per-head" else (1, 1)
    mask = None if mask_cover is None else (rng.random(lead + (7, 11)) < 0.7).astype(f64)
    bias = None
    if variant.bias != "none":
        lead = (dims.batch, dims.heads) if variant.bias == PER_HEAD else (1, 1)
        bias = rng.standard_normal(lead + (7, 11))
        bias[rng.random(bias.shape) < 0.1] = -np.inf
    return _tensors(dims, variant, mask, bias, np.exp2(-rng.uniform(0, 8, (2, 4))) if variant.alibi else None)


@pytest.mark.parametrize("variant,mask_cover", VARIANT_MASKS)
def test_the_sdpa_mask_is_the_variants(variant, mask_cover):
    """The attn_mask SDPA gets hides what verify.variant hides and adds what it adds: boolean
    (True keeps) when only hiding, float (−inf where hidden) when adding; GQA asks enable_gqa."""
    t = _variant_tensors(variant, mask_cover)
    want = _reference_scores(t)
    got = attention_mask(t)
    if variant.modifies_scores:
        assert got.dtype == f64 and np.array_equal(np.broadcast_to(got, want.shape), want)
    else:
        assert got.dtype == bool and np.array_equal(np.broadcast_to(got, want.shape), np.isfinite(want))
    call = sdpa_call(t, "math", "bf16")
    assert call.enable_gqa and call.attn_mask is not None and not call.is_causal


@pytest.mark.parametrize("variant,mask_cover", VARIANT_MASKS + [
    pytest.param(Variant(softcap=3.0, alibi=True, causal=True, align=BOTTOM_RIGHT), None, id="softcap-alibi")])
def test_the_flex_mods_are_the_variants(variant, mask_cover):
    """Flex's score_mod and mask_mod, evaluated by NumPy on Flex's index grids, give the scores
    verify.variant gives (softcap, ALiBi, bias in the contract's order) and hide what it hides."""
    t = _variant_tensors(variant, mask_cover)
    want = _reference_scores(t)
    rng = np.random.default_rng(1)
    scaled = rng.standard_normal(t.shape) * 4
    arrays = flex_arrays(t)
    score_mod, mask_mod = score_mod_of(t, arrays, np), mask_mod_of(t, arrays)
    grid = _grids(t)
    keep = np.broadcast_to(mask_mod(*grid), t.shape) if mask_mod else np.ones(t.shape, bool)
    got = np.where(keep, score_mod(scaled, *grid) if score_mod else scaled, -np.inf)
    for b in range(t.shape[0]):
        for h in range(t.shape[1]):
            slope = t.slopes[b, h] if variant.alibi else 0.0
            bias = None if t.bias is None else np.broadcast_to(t.bias, t.shape)[b, h]
            expected = np.where(np.isfinite(want[b, h]), modified_scores(scaled[b, h], variant, slope, bias), -np.inf)
            # the slopes and the bias go to Flex as float32, as its kernel computes in float32
            np.testing.assert_allclose(got[b, h], expected, rtol=1e-6, atol=1e-6)


def test_a_document_mask_becomes_document_ids_and_other_masks_are_looked_up():
    """A block-diagonal mask (rows that see no key too) becomes Flex's document ids; prefix-LM and
    random masks stay entry-by-entry lookups."""
    docs_k = np.array([0, 0, 1, 1, 1, 2, 2])
    docs_q = np.array([0, 1, 1, -1, 2])
    keep = docs_q[:, None] == docs_k[None, :]
    q_doc, kv_doc = document_ids(np.stack([keep, keep[::-1]]))
    assert np.array_equal(q_doc[0][:, None] == kv_doc[0][None, :], keep)
    assert np.array_equal(q_doc[1][:, None] == kv_doc[1][None, :], keep[::-1]) and q_doc[0][3] == -1
    prefix = (np.arange(7)[None, :] < 2) | np.tri(5, 7, dtype=bool)
    assert document_ids(prefix) is None and document_ids(np.eye(5, 7, dtype=bool)) is not None
    dims = Dims(1, 2, 5, 7, 16, 16)
    t = _tensors(dims, Variant(mask=BROADCAST), mask=keep[None, None].astype(f64))
    assert set(flex_arrays(t)) == {Q_DOC, KV_DOC}
    t = _tensors(dims, Variant(mask=PER_HEAD, alibi=True, bias=BROADCAST), mask=np.broadcast_to(prefix, (1, 2, 5, 7)),
                 bias=np.zeros((1, 1, 5, 7)))
    arrays = flex_arrays(t)
    assert set(arrays) == {KEEP, SLOPES, BIAS} and arrays[KEEP].shape == (1, 2, 5, 7) and arrays[BIAS].shape == (5, 7)


def test_what_sdpa_or_flex_cannot_compute_is_unavailable_and_a_rounded_mask_is_said():
    """Softcap and dropout: SDPA unavailable (softcap pointing to Flex); dropout: Flex too. A float
    mask that the format cannot hold exactly is noted for the fused backends only."""
    dims = Dims(1, 6, 9, 300, 16, 16)
    with pytest.raises(BackendUnavailable, match="no softcap.*--backend flex"):
        sdpa_call(_tensors(dims, Variant(softcap=30.0)), "math", "bf16")
    with pytest.raises(BackendUnavailable, match="dropout"):
        sdpa_call(_tensors(dims, Variant(dropout=0.1)), "math", "bf16")
    alibi6 = _tensors(dims, Variant(alibi=True))  # slopes 2^(-8/6 ...): not bf16 values
    assert any("rounded to bf16" in n for n in sdpa_call(alibi6, "efficient", "bf16").notes)
    assert sdpa_call(alibi6, "math", "bf16").notes == []
    alibi8 = _tensors(Dims(1, 8, 9, 200, 16, 16), Variant(alibi=True))  # 2^-k times distances < 256: exact
    assert sdpa_call(alibi8, "efficient", "bf16").notes == []


def test_stage_files_of_grouped_gradients_keep_their_kv_heads(tmp_path):
    """dK and dV of Hk heads are written as (B, Hk, M, d), the lse as float32, fp16 values as fp16."""
    results = Results(np.ones((2, 6, 5, 4), np.float32), np.zeros((2, 6, 5), np.float32),
                      {"dq": np.ones((2, 6, 5, 4), np.float32), "dk": np.ones((2, 2, 7, 4), np.float32),
                       "dv": np.ones((2, 2, 7, 4), np.float32)})
    stages = stage_arrays(results, fused=True)
    write_stage_files(tmp_path / "out", stages, "fp16")
    dk = np.load(tmp_path / "out" / f"{FLASH_GRAD_KEYS}.npy")
    assert dk.shape == (2, 2, 7, 4) and dk.dtype == np.float16
    assert np.load(tmp_path / "out" / "flash_lse.npy").dtype == np.float32


# ---- variant cases end to end with the stand-ins: generate, write, check -----------------------

# attnstep generate's options of each variant (docs/cli.md) and the case's dims.
VARIANT_CASES = [
    pytest.param(Dims(1, 6, 37, 53, 24, 24, kv_heads=2), (), id="gqa-H6-Hk2-N37-M53"),
    pytest.param(Dims(1, 3, 37, 53, 24, 24, kv_heads=1), ("--causal",), id="mqa-causal-top-left"),
    pytest.param(Dims(1, 2, 53, 37, 24, 24), ("--causal", "bottom-right"), id="causal-bottom-right-N53-M37"),
    pytest.param(Dims(1, 2, 37, 53, 24, 24), ("--window", "8,3", "--align", "bottom-right"), id="window-8-3"),
    pytest.param(Dims(1, 4, 37, 53, 24, 24), ("--alibi", "--causal"), id="alibi-causal"),
    pytest.param(Dims(1, 2, 37, 53, 24, 24), ("--mask", "document", "--mask-heads", "per-head"), id="document"),
    pytest.param(Dims(1, 2, 37, 53, 24, 24), ("--bias", "random", "--bias-heads", "broadcast"), id="bias"),
]


def _variant_case(tmp_path, dims, options, seed=7, dist="normal"):
    args = ["generate", "--out", tmp_path / "in", "--batch", dims.batch, "--heads", dims.heads, "--seq-q",
            dims.seq_q, "--seq-k", dims.seq_k, "--d-k", dims.d_k, "--d-v", dims.d_v, "--dist", dist,
            "--seed", seed, "--format", "npy", "--backward", *options]
    if dims.kv_heads:
        args += ["--kv-heads", dims.kv_heads]
    r = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return tmp_path / "in"


@pytest.mark.parametrize("dims,options", VARIANT_CASES)
def test_sdpa_and_flex_are_given_the_same_attention(tmp_path, dims, options):
    """The two routes from a generated case to a program, SDPA's attn_mask (verify.variant's
    functions) and Flex's mods (index arithmetic, document ids), compute the same attention,
    forward and backward, K/V heads and all."""
    t = case_tensors(load_input_case(_variant_case(tmp_path, dims, options)), "fp32")
    by_sdpa, by_flex = numpy_sdpa(sdpa_call(t, "math", "fp32"), "math", "fp32"), numpy_flex(t, "fp32")
    np.testing.assert_allclose(by_sdpa.out, by_flex.out, rtol=1e-5, atol=1e-6)
    for grad in by_flex.grads:
        np.testing.assert_allclose(by_sdpa.grads[grad], by_flex.grads[grad], rtol=1e-5, atol=1e-5)
    assert by_flex.grads["dk"].shape[:2] == (dims.batch, dims.kv) and np.isfinite(by_flex.out).all()


@pytest.mark.parametrize("dims,options", VARIANT_CASES)
def test_stand_ins_of_sdpa_and_flex_pass_on_every_variant(tmp_path, dims, options):
    """What SDPA (its math backend) and Flex are given for the variant, computed by the stand-ins,
    passes `check`; dK comes with the case's K/V heads."""
    in_dir = _variant_case(tmp_path, dims, options)
    for name, write in (("sdpa", lambda o: write_sdpa_case(in_dir, o, "math", "bf16", runner=numpy_sdpa)),
                        ("flex", lambda o: write_flex_case(in_dir, o, "bf16", runner=numpy_flex))):
        write(tmp_path / name)
        code, report = _check(in_dir, tmp_path / name, "bf16", tmp_path)
        assert code == 0, (name, _failures(report))
    assert np.load(tmp_path / "flex" / f"{FLASH_GRAD_KEYS}.npy").shape[:2] == (dims.batch, dims.kv)


# Each planted bug's case for the stand-ins (the bugs: tests/helpers/planted_variants.py).
STAND_IN_PLANTS = {OTHER_ALIGNMENT: (Dims(1, 2, 37, 53, 24, 24), ("--causal", "bottom-right"), "normal"),
                   WINDOW_OFF_BY_ONE: (Dims(1, 2, 48, 61, 24, 24), ("--window", "16,0"), "normal"),
                   SOFTCAP_LEFT_OUT: (Dims(1, 2, 37, 53, 24, 24), ("--softcap", "30"), "large"),
                   ALIBI_REVERSED: (Dims(1, 4, 37, 53, 24, 24), ("--alibi",), "normal"),
                   DK_ONE_HEAD: (Dims(1, 6, 37, 53, 24, 24, kv_heads=2), (), "normal")}


@pytest.mark.parametrize("program", ["math", "flex"])
@pytest.mark.parametrize("bug", PLANTS)
def test_a_planted_bug_fails_the_stand_in_where_it_starts(tmp_path, bug, program):
    """Each planted bug, given to SDPA's (math) or Flex's stand-in, fails where the GPU test
    expects it to with the real programs."""
    if program != "flex" and bug in SDPA_CANNOT:
        pytest.skip("SDPA has no softcap to leave out")
    dims, options, dist = STAND_IN_PLANTS[bug]
    in_dir = _variant_case(tmp_path, dims, options, dist=dist)
    out_dir = tmp_path / "out"
    if program == "flex":
        write_flex_case(in_dir, out_dir, "bf16", runner=numpy_flex, plant=PLANTS[bug])
    else:
        write_sdpa_case(in_dir, out_dir, program, "bf16", runner=numpy_sdpa, plant=PLANTS[bug])
    dk = one_head_dk(out_dir, dims, "bf16") if bug == DK_ONE_HEAD else None
    code, report = _check(in_dir, out_dir, "bf16", tmp_path)
    assert_fails_where_it_starts(code, report, bug, program == "flex", dk)


# ---- PyTorch's SDPA on the GPU -----------------------------------------------------------------

def _sdpa_or_skip(in_dir, out_dir, backend, precision, **kwargs):
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("PyTorch is not installed")
    try:
        return write_sdpa_case(in_dir, out_dir, backend, precision, **kwargs)
    except BackendUnavailable as exc:
        pytest.skip(f"torch cannot run this SDPA backend here: {exc}")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", HALF_PRECISIONS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dims,causal", SHAPES)
def test_pytorch_sdpa_passes(tmp_path, dims, causal, backend, precision):
    in_dir = _case(tmp_path, dims, causal)
    results = _sdpa_or_skip(in_dir, tmp_path / "out", backend, precision)
    written = stage_arrays(results, BACKENDS[backend].fused)
    code, report = _check(in_dir, tmp_path / "out", precision, tmp_path)
    assert code == 0 and report["passed"], (results.notes, _failures(report))
    assert {r["stage"] for r in report["results"]} == set(written)
    assert len(written) == (5 if BACKENDS[backend].fused else 4) or results.notes, written


@pytest.mark.gpu
@pytest.mark.parametrize("precision", HALF_PRECISIONS)
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "flash"])
def test_pytorch_sdpa_with_an_explicit_causal_mask_passes(tmp_path, backend, precision):
    """The top-left causal mask as a boolean attn_mask (N < M and N > M), through the backends'
    masked paths."""
    for i, dims in enumerate((Dims(1, 2, 70, 190, 64, 64), Dims(1, 2, 190, 70, 128, 128))):
        in_dir = _case(tmp_path / str(i), dims, True)
        _sdpa_or_skip(in_dir, tmp_path / str(i) / "out", backend, precision, mask=EXPLICIT)
        code, report = _check(in_dir, tmp_path / str(i) / "out", precision, tmp_path)
        assert code == 0 and report["passed"], _failures(report)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", HALF_PRECISIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_pytorch_sdpa_with_a_planted_bug_fails(tmp_path, backend, precision):
    """The control: SDPA's dK with one element moved fails at dK; SDPA at 1.25 times the case's
    scale fails at its output."""
    dims, causal = CONTROL
    in_dir = _case(tmp_path, dims, causal)
    out_dir = tmp_path / "out"
    written = stage_arrays(_sdpa_or_skip(in_dir, out_dir, backend, precision), BACKENDS[backend].fused)
    dk = [s for s in written if STAGES[s].rows == "M" and STAGES[s].cols == "DK"][0]
    _perturb(out_dir, dk, precision)
    code, report = _check(in_dir, out_dir, precision, tmp_path)
    assert code == 1 and _failures(report) == [(dk, dims.total_heads - 1, "FAIL")], _failures(report)

    _sdpa_or_skip(in_dir, out_dir, backend, precision, scale=1.25 * dims.d_k ** -0.5)
    code, report = _check(in_dir, out_dir, precision, tmp_path)
    assert code == 1 and report["first_failing_stage"] == next(iter(written)), _failures(report)
