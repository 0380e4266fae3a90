"""The Python API's variants, layouts and tensors: check_arrays takes flash-attn's BSHD layout and
names a layout mismatch, takes k and v with fewer heads (GQA), PyTorch tensors (a stand-in here;
the real thing where torch is installed), and the variant's arguments, each validated in one line.
What the engine then computes is the engine's tests' business: here the case and the run that
check_arrays hands it are captured."""
from __future__ import annotations

import sys

import numpy as np
import pytest

import attnstep
import verify.api as api
from helpers import foreign_routes as foreign
from helpers.variants import FakeTensor, bf16_values
from verify.stages import BIAS_INPUT, DROPOUT_MASK, KEYS, MASK_INPUT, OUTPUT, WEIGHTS
from verify.variant import BOTTOM_RIGHT, BROADCAST, NONE, PER_HEAD, TOP_LEFT, alibi_slopes

f32 = np.float32
B, H, HK, N, M, D = 2, 6, 2, 37, 53, 24


def _qkv(heads=H, kv=HK, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.random((B, heads, N, D), dtype=f32), rng.random((B, kv, M, D), dtype=f32),
            rng.random((B, kv, M, D), dtype=f32))


@pytest.fixture
def handed(monkeypatch):
    """check_arrays' engine call captured: {'run': RunInfo, 'case': InputCase} after a call."""
    got = {}

    def capture(run, case, options, diagnoser=None):
        got.update(run=run, case=case, options=options)
        return "report"
    monkeypatch.setattr(api, "check_run", capture)
    return got


def _plain(seed=1, causal=False):
    """q, k, v (B, H, N, d) and the correct output and flash_lse of plain attention."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.random((2, 3, n, 16), dtype=f32) for n in (20, 30, 30))
    heads = [foreign.compute_head(q.reshape(6, 20, 16)[i], k.reshape(6, 30, 16)[i], v.reshape(6, 30, 16)[i], 0.25,
                                  causal) for i in range(6)]
    out = np.stack([h[OUTPUT] for h in heads]).reshape(2, 3, 20, 16)
    lse = np.stack([h["flash_lse"] for h in heads]).reshape(2, 3, 20)
    return q, k, v, out, lse


# ---- layouts -------------------------------------------------------------------------------------

def test_bshd_arrays_check_as_their_bhsd_transpose():
    q, k, v, out, lse = _plain()
    assert attnstep.check_arrays(q, k, v, {OUTPUT: out, "flash_lse": lse}, scale=0.25).passed
    bshd = [x.transpose(0, 2, 1, 3) for x in (q, k, v, out)]
    report = attnstep.check_arrays(*bshd[:3], {OUTPUT: bshd[3], "flash_lse": lse}, scale=0.25, layout="bshd")
    assert report.passed  # lse stays (B, H, N), as flash-attn returns it
    wrong = bshd[3].copy()
    wrong[1, 4, 2, 5] += 0.01  # batch 1, row 4, head 2
    report = attnstep.check_arrays(*bshd[:3], {OUTPUT: wrong}, scale=0.25, layout="bshd")
    assert not report.passed and "b1 h2 [4,5]" in api.format_report(report)


def test_a_layout_mismatch_is_named_not_just_a_shape():
    q, k, v, out, _ = _plain()
    bshd = [x.transpose(0, 2, 1, 3) for x in (q, k, v, out)]
    with pytest.raises(ValueError) as exc:
        attnstep.check_arrays(*bshd[:3], {OUTPUT: bshd[3]}, scale=0.25)
    assert str(exc.value).startswith('q is (2, 20, 3, 16): that is BSHD; pass layout="bshd"')
    with pytest.raises(ValueError, match=r'q is \(2, 3, 20, 16\): that is BHSD; pass layout="bhsd"'):
        attnstep.check_arrays(q, k, v, {OUTPUT: out}, layout="bshd")
    with pytest.raises(ValueError, match=r"output is \(2, 20, 3, 16\): that is BSHD, and q, k, v are BHSD"):
        attnstep.check_arrays(q, k, v, {OUTPUT: bshd[3]}, scale=0.25)


def test_a_layout_that_fits_both_ways_gets_a_note_when_it_reads_more_heads_than_rows(handed):
    rng = np.random.default_rng(2)
    q, k, v = (rng.random((1, 64, 4, 8), dtype=f32) for _ in range(3))  # BSHD: 64 rows of 4 heads
    attnstep.check_arrays(q, k, v, {OUTPUT: q})
    assert any('read as BHSD, 64 heads of 4 rows; if it is BSHD, pass layout="bshd"' in n for n in handed["run"].notes)
    attnstep.check_arrays(q, k, v, {OUTPUT: q}, layout="bshd")
    assert not any("pass layout" in n for n in handed["run"].notes)


@pytest.mark.parametrize("shapes, words", [
    (((2, 6, 37, 24), (2, 4, 53, 24), (2, 4, 53, 24)), "k and v have 4 heads and q 6: grouped K/V heads (GQA) must "
                                                        "divide the query heads"),
    (((2, 6, 37, 24), (2, 2, 53, 24), (2, 3, 53, 24)), "k has 2 heads, v 3"),
    (((2, 6, 37, 24), (2, 2, 53, 16), (2, 2, 53, 24)), "q's head dimension is 24, k's 16"),
    (((2, 6, 37, 24), (2, 2, 53, 24), (2, 2, 50, 24)), "k has 53 keys, v 50"),
    (((2, 6, 37, 24), (1, 2, 53, 24), (1, 2, 53, 24)), "batch 2, 1 and 1"),
    (((2, 6, 37, 24), (2, 53, 24), (2, 53, 24)), "q, k, v have 4, 3 and 3 axes"),
], ids=["kv-not-dividing", "k-v-heads", "d_k", "seq_k", "batch", "ranks"])
def test_shapes_that_fit_no_layout_say_why(shapes, words):
    q, k, v = (np.zeros(s, f32) for s in shapes)
    with pytest.raises(ValueError) as exc:
        attnstep.check_arrays(q, k, v, {OUTPUT: np.zeros((2, 6, 37, 24), f32)})
    assert words in str(exc.value) and "\n" not in str(exc.value)


# ---- GQA -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_k_and_v_with_fewer_heads_are_grouped_heads(handed, layout):
    q, k, v = _qkv()
    dk = np.arange(B * HK * M * D, dtype=f32).reshape(B, HK, M, D)
    if layout == "bshd":
        q, k, v, dk = (x.transpose(0, 2, 1, 3) for x in (q, k, v, dk))
    attnstep.check_arrays(q, k, v, {"dK": dk, OUTPUT: np.zeros_like(q)}, do=np.zeros_like(q), layout=layout)
    case, run = handed["case"], handed["run"]
    assert (case.dims.heads, case.dims.kv, case.dims.group_size) == (H, HK, 3)
    kb = k if layout == "bhsd" else k.transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(case.load(KEYS, 3), kb[1, 1])  # K/V head b·Hk + g
    dkb = dk if layout == "bhsd" else dk.transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(run.read("dK", 2)[0], dkb[1, 0])
    with pytest.raises(ValueError, match=r"dK: shape \(2, 6, 53, 24\), expected 4 heads of 53x24"):
        per_query = np.zeros((B, H, M, D), f32)
        attnstep.check_arrays(*_qkv(), {"dK": per_query}, do=np.zeros((B, H, N, D), f32))


# ---- tensors -------------------------------------------------------------------------------------

def test_tensors_are_converted_without_torch():
    q, k, v, out, lse = _plain()
    calls = []
    tensors = [FakeTensor(bf16_values(x), "torch.bfloat16", "cuda:0", calls) for x in (q, k, v)]
    stages = {OUTPUT: FakeTensor(out, "torch.float64", "cuda:0", calls),
              "flash_lse": FakeTensor(lse.astype(f32), "torch.float32", "cpu", calls)}
    report = attnstep.check_arrays(*tensors, stages, scale=0.25, atol=1e-2)
    assert report.passed
    assert calls.count("detach") == 5 and calls.count("cpu") == 5 and calls.count("float") == 4  # (float64 kept)
    if "torch" not in sys.modules:
        assert "torch" not in sys.modules  # nothing imported it on the way


def test_a_bf16_tensor_at_fp32_keeps_its_half_precision_note(handed):
    q, k, v = (bf16_values(x) for x in _qkv(heads=2, kv=2))
    attnstep.check_arrays(*(FakeTensor(x, "torch.bfloat16") for x in (q, k, v)), {OUTPUT: q})
    held = handed["case"].load("Q", 0)
    assert held.dtype == f32 and np.array_equal(held, q[0, 0])


def test_a_float16_tensor_reads_as_the_float16_array_does():
    """Results computed in float32 and stored in float16: half a float16 unit allowed, tensor or array."""
    q, k, v, out, _ = _plain()
    stored = out.astype(np.float16)
    for given in (stored, FakeTensor(stored, "torch.float16")):
        report = attnstep.check_arrays(q, k, v, {OUTPUT: given}, scale=0.25)
        assert report.passed and report.stage_results(OUTPUT)[0].resolution == "float16"


def test_a_real_torch_tensor_checks_directly():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed here: the stand-in tests cover the "
                                                 "conversion")
    q, k, v, out, lse = _plain()
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    report = attnstep.check_arrays(tq, tk, tv, {OUTPUT: torch.tensor(out), "flash_lse": torch.tensor(lse)},
                                   scale=0.25)
    assert report.passed


@pytest.mark.gpu
def test_cuda_bf16_tensors_from_sdpa_with_gqa_check_directly():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for PyTorch")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.rand(2, 6, 37, 32, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.rand(2, 2, 53, 32, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert attnstep.check_arrays(q, k, v, {OUTPUT: out}, precision="bf16").passed


# ---- the variant's arguments ---------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, want", [
    (dict(causal=True), dict(causal=True, align=TOP_LEFT)),
    (dict(causal="bottom-right"), dict(causal=True, align=BOTTOM_RIGHT)),
    (dict(causal="top-left", align="top-left"), dict(causal=True, align=TOP_LEFT)),
    (dict(align="bottom-right", window=(8, 8)), dict(causal=False, align=BOTTOM_RIGHT, window=(8, 8))),
    (dict(causal=True, window=[16, 0]), dict(window=(16, 0))),
    (dict(softcap=30), dict(softcap=30.0)),
    (dict(softcap=None), dict(softcap=0.0)),
    (dict(alibi=True), dict(alibi=True)),
    (dict(dropout_p=0.0), dict(dropout=0.0)),
], ids=lambda x: None)
def test_the_variant_arguments_make_the_variant(handed, kwargs, want):
    q, k, v = _qkv()
    attnstep.check_arrays(q, k, v, {OUTPUT: np.zeros_like(q)}, **kwargs)
    variant = handed["case"].variant
    assert handed["run"].variant == variant and handed["run"].causal == variant.causal == handed["case"].causal
    for name, value in want.items():
        assert getattr(variant, name) == value, name


def test_alibi_slopes_per_head_or_per_batch_element(handed):
    q, k, v = _qkv()
    attnstep.check_arrays(q, k, v, {OUTPUT: q}, alibi=True)
    assert handed["case"].alibi_slope(7) == alibi_slopes(H)[1]
    attnstep.check_arrays(q, k, v, {OUTPUT: q}, alibi=np.arange(1, 7, dtype=f32) / 8)
    assert handed["case"].variant.alibi and handed["case"].alibi_slope(7) == 2 / 8
    attnstep.check_arrays(q, k, v, {OUTPUT: q}, alibi=FakeTensor(np.arange(12, dtype=np.float64).reshape(2, 6)))
    assert handed["case"].alibi_slope(7) == 7.0


@pytest.mark.parametrize("shape, coverage", [
    ((N, M), BROADCAST), ((1, 1, N, M), BROADCAST), ((1, N, M), BROADCAST),
    ((B, 1, N, M), PER_HEAD), ((H, N, M), PER_HEAD), ((B, H, N, M), PER_HEAD),
], ids=str)
def test_masks_and_biases_broadcast_as_pytorch_attn_mask(handed, shape, coverage):
    q, k, v = _qkv()
    rng = np.random.default_rng(4)
    mask = rng.random(shape) < 0.7
    bias = rng.standard_normal(shape)
    bias[..., 0] = -np.inf
    attnstep.check_arrays(q, k, v, {OUTPUT: q}, attn_mask=FakeTensor(mask, "torch.bool"), attn_bias=bias)
    case = handed["case"]
    assert (case.variant.mask, case.variant.bias) == (coverage, coverage)
    full_mask = np.broadcast_to(mask.reshape((1,) * (4 - mask.ndim) + shape), (B, H, N, M))
    full_bias = np.broadcast_to(bias.reshape((1,) * (4 - bias.ndim) + shape), (B, H, N, M))
    for i in (0, 7, 11):
        np.testing.assert_array_equal(case.variant_input(MASK_INPUT, i), full_mask[divmod(i, H)].astype(float))
        np.testing.assert_array_equal(case.variant_input(BIAS_INPUT, i), full_bias[divmod(i, H)])
    attnstep.check_arrays(q, k, v, {OUTPUT: q})
    assert handed["case"].variant_input(MASK_INPUT, 0) is None and handed["case"].variant.mask == NONE


def test_a_dropout_mask_goes_with_dropout_p(handed):
    q, k, v = _qkv()
    weights = np.zeros((B, H, N, M), f32)
    keep = np.ones((B, H, N, M), f32)
    attnstep.check_arrays(q, k, v, {WEIGHTS: weights, DROPOUT_MASK: keep}, dropout_p=0.1)
    assert handed["run"].variant.dropout == 0.1 and DROPOUT_MASK in handed["run"].stages
    with pytest.raises(ValueError, match=f"stage '{DROPOUT_MASK}' is a dropout keep-mask: pass dropout_p="):
        attnstep.check_arrays(q, k, v, {DROPOUT_MASK: keep})
    with pytest.raises(ValueError, match=r"dropout_p=0.1: pass the program's keep-mask too, as "
                                         rf"stages\['{DROPOUT_MASK}'\]"):
        attnstep.check_arrays(q, k, v, {WEIGHTS: weights}, dropout_p=0.1)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(causal="bottom_right"), TypeError, "causal: expected True or False, got str 'bottom_right'; or the "
                                             "alignment of the causal mask: 'top-left' or 'bottom-right'"),
    (dict(causal="top-left", align="bottom-right"), ValueError, "causal='top-left' with align='bottom-right': choose"),
    (dict(align="left"), ValueError, "align 'left': expected one of top-left, bottom-right"),
    (dict(window=5), TypeError, "window: expected (left, right), two whole numbers (-1: unbounded), got 5"),
    (dict(window=(1.5, 0)), TypeError, "window: expected (left, right)"),
    (dict(window=(3, -2)), ValueError, "window = (3, -2): each side is a number of keys from 0 to 2147483647, "
                                       "or -1 (unbounded)"),
    (dict(window=(10**30, 0)), ValueError, "window = (1000000000000000000000000000000, 0): each side is a number "
                                           "of keys from 0 to 2147483647"),
    (dict(window=(0, 2**31)), ValueError, "window = (0, 2147483648): each side"),
    (dict(causal=True, window=(3, 2)), ValueError, "causal with window: window_right = 2: a causal mask sees no key"),
    (dict(softcap=-1.0), ValueError, "softcap = -1.0: must be a finite number > 0 (0: none)"),
    (dict(softcap=float("inf")), ValueError, "softcap = inf"),
    (dict(softcap="30"), TypeError, "softcap: expected a number"),
    (dict(alibi="yes"), TypeError, "alibi: expected True, False or the slopes ((H,) or (B, H)), got str 'yes'"),
    (dict(alibi=None), TypeError, "alibi: expected True, False or the slopes"),
    (dict(alibi=np.ones(4)), ValueError, "alibi: slopes of shape (4,); expected (6,) or (2, 6)"),
    (dict(alibi=np.array([1, 1, 1, 1, 1, np.nan])), ValueError, "alibi: nan among the slopes; slopes must be finite"),
    (dict(dropout_p=1.0), ValueError, "dropout_p = 1.0: must be a probability in [0, 1)"),
    (dict(dropout_p=True), TypeError, "dropout_p: expected a number, got bool True"),
    (dict(layout="sbhd"), ValueError, "layout 'sbhd': expected one of bhsd, bshd"),
    (dict(attn_mask=np.full((N, M), 0.5)), ValueError, "attn_mask holds 0.5 at (0, 0): a mask holds True/False or "
                                                        "0/1; PyTorch adds a float attn_mask to the scores: pass that "
                                                        "as attn_bias="),
    (dict(attn_mask=np.ones((N, M + 1), bool)), ValueError, "attn_mask: shape (37, 54) does not broadcast to (B, H, "
                                                            "N, M) = (2, 6, 37, 53)"),
    (dict(attn_mask=np.ones(M, bool)), ValueError, "attn_mask: 1-d array; expected (N, M) = (37, 53)"),
    (dict(attn_mask=np.array([["a"]])), ValueError, "attn_mask: dtype <U1; expected bool"),
    (dict(attn_bias=np.full((N, M), np.inf)), ValueError, "attn_bias holds inf at (0, 0): a bias holds finite values "
                                                          "or -inf"),
    (dict(attn_bias=np.full((N, M), np.nan)), ValueError, "attn_bias holds nan at (0, 0)"),
], ids=lambda x: None)
def test_bad_variant_arguments_are_one_line_naming_the_argument(kwargs, error, words):
    q, k, v = _qkv()
    with pytest.raises(error) as exc:
        attnstep.check_arrays(q, k, v, {OUTPUT: np.zeros_like(q)}, **kwargs)
    assert words in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
