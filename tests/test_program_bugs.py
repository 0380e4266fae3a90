"""Real programs' bugs, named first: each planted by a small program of its own kind
(tests/helpers/buggy_programs.py) that writes its stage files as such a program would (%.9g text, no
run.toml, only the stages it computes), then checked as a user checks it. The same program without
its bug passes with no diagnosis.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import pytest

import attnstep

from helpers import buggy_programs as bp
from helpers import foreign_routes as foreign
from helpers.cli import check_folder, generate_input, invoke
from verify.stages import Dims, default_scale

STAGE_PATH = ("QK", "QK_scaled", "attention_weights", "output")
SQUARE = Dims(1, 2, 128, 128, 64, 64)
PAST_TILE = Dims(1, 3, 100, 100, 64, 64)   # 100 = 3 tiles of 32 and 4 keys
TILE = 32


def _check(tmp: Path, dims: Dims, program: Callable, stages: Sequence[str], dist: str = "normal",
           causal: bool = False, scale: Optional[float] = None, writer: str = "g9"):
    in_dir = generate_input(tmp / "in", dims, dist, 7, causal)
    heads = program(foreign.read_inputs(in_dir, dims.total_heads))
    foreign.write_outputs(tmp / "out", heads, dims, writer, only=stages)
    return check_folder(tmp, in_dir, tmp / "out", causal, scale)


def _failed(report: dict, stage: str):
    """Every head's result of `stage`, each failing."""
    entries = [e for e in report["results"] if e["stage"] == stage]
    assert entries and all(e["status"] == "FAIL" for e in entries), [(e["head"], e["status"]) for e in entries]
    return entries


def _first(entry: dict) -> dict:
    assert entry["diagnosis"], entry
    return entry["diagnosis"][0]


def _assert_named_first(report: dict, stage: str, code: str):
    assert report["first_failing_stage"] == stage, report["first_failing_stage"]
    for entry in _failed(report, stage):
        d = _first(entry)
        assert d["code"] == code, (entry["head"], [(x["code"], x["message"]) for x in entry["diagnosis"]])
    return [_first(e) for e in _failed(report, stage)]


def _assert_passes(result, report):
    assert result.exit_code == 0, result.output
    assert all(not e["diagnosis"] for e in report["results"]), [e["diagnosis"] for e in report["results"]]


# ---- a softmax without the max subtracted ---------------------------------------------------------

@pytest.mark.parametrize("stages", [STAGE_PATH, ("output",)], ids=["stage-path", "output-only"])
def test_an_overflowing_softmax_is_named_overflow_not_unwritten(tmp_path, stages):
    """Logits in the hundreds (--dist large): exp overflows, inf/inf writes NaN where the logits are
    large. That is overflow, never a region left unwritten."""
    scale = default_scale(SQUARE.d_k)
    result, report = _check(tmp_path, SQUARE, lambda x: bp.softmax_program(x, scale, False), stages, "large")
    stage = stages[-2] if len(stages) > 1 else stages[0]  # the weights, or the output alone
    for d in _assert_named_first(report, stage, "overflow"):
        assert d["detail"]["max_logit"] > 88.7 and "row max" in d["message"]
    for entry in _failed(report, stage):
        assert "unwritten" not in [x["code"] for x in entry["diagnosis"]]


@pytest.mark.parametrize("stages", [STAGE_PATH, ("output",)], ids=["stage-path", "output-only"])
def test_the_same_softmax_with_the_max_subtracted_passes(tmp_path, stages):
    scale = default_scale(SQUARE.d_k)
    _assert_passes(*_check(tmp_path, SQUARE, lambda x: bp.softmax_program(x, scale, True), stages, "large"))


# ---- key tiles read past the end, or left out --------------------------------------------------------

def test_a_tile_reading_past_the_end_of_a_head_is_named_in_every_head(tmp_path):
    """flash-attention-minimal at N = 100 with tiles of 32: the last tile's 28 extra keys are the next
    head's first keys (zeros past the last head), and its rows past the end land on the next head's
    first output rows."""
    scale = default_scale(PAST_TILE.d_k)
    result, report = _check(tmp_path, PAST_TILE, lambda x: bp.flash_minimal_program(x, scale, TILE),
                            ("flash_output",))
    found = _assert_named_first(report, "flash_output", "keys_past_end")
    assert all(d["detail"]["extra_keys"] == 28 and TILE in d["detail"]["tiles"] for d in found)
    assert [d["detail"]["source"].split()[0] for d in found] == ["the", "the", "28"]  # next head, next, zeros
    assert "previous head's overrun" in found[1]["message"] and "overrun" not in found[0]["message"]


def test_keys_past_the_last_full_tile_left_out_are_named_with_the_tile(tmp_path):
    """A kernel of floor(M / 32) key tiles (and as many query tiles): keys 96..99 are missing from every
    row and rows 96..99 are never written; both are named, the keys first."""
    scale = default_scale(PAST_TILE.d_k)
    result, report = _check(tmp_path, PAST_TILE, lambda x: bp.dropped_tail_program(x, scale, TILE),
                            ("flash_output",))
    for d in _assert_named_first(report, "flash_output", "keys_dropped"):
        assert d["detail"]["dropped"] == [96, 99] and TILE in d["detail"]["tiles"]
        assert "tile of 16 or 32 keys (as of any tile width t with M mod t = 4: also 8, 12, 24, 48 or 96)" \
            in d["message"], d["message"]
    for entry in _failed(report, "flash_output"):
        assert "unwritten" in [x["code"] for x in entry["diagnosis"]]


@pytest.mark.parametrize("program", ["flash_minimal_program", "dropped_tail_program"])
def test_the_same_tiled_kernels_pass_when_the_tiles_fit(tmp_path, program):
    dims = Dims(1, 3, 96, 96, 64, 64)
    scale = default_scale(dims.d_k)
    _assert_passes(*_check(tmp_path, dims, lambda x: getattr(bp, program)(x, scale, TILE), ("flash_output",)))


# ---- the mask at any offset, wherever it is seen --------------------------------------------------

WIDE = Dims(1, 2, 32, 128, 64, 64)   # M - N = 96
TALL = Dims(1, 2, 80, 48, 16, 16)


def _masked(dims: Dims, offset: int):
    return lambda x: bp.masked_program(x, default_scale(dims.d_k), offset)


def _flash_masked(dims: Dims, offset: int):
    def program(inputs):
        scale = default_scale(dims.d_k)
        with np.errstate(invalid="ignore"):  # a row with no visible key in its first tile: -inf - -inf
            return [{"flash_output": foreign.flash_forward(x["Q"], x["K"], x["V"], scale, True, 32, False,
                                                           offset)[0]} for x in inputs]
    return program


MASKS = [  # (id, dims, program, stages written, the stage named, offset)
    ("bottom-right-stage-path", WIDE, _masked(WIDE, 96), STAGE_PATH, "QK_scaled", 96),
    ("bottom-right-output-only", WIDE, _masked(WIDE, 96), ("output",), "output", 96),
    ("bottom-right-flash-only", WIDE, _flash_masked(WIDE, 96), ("flash_output",), "flash_output", 96),
    ("offset-37-output-only", WIDE, _masked(WIDE, 37), ("output",), "output", 37),
    ("shift+1-N>M-output-only", TALL, _masked(TALL, 1), ("output",), "output", 1),
    ("shift-2-N>M-flash-only", TALL, _flash_masked(TALL, -2), ("flash_output",), "flash_output", -2),
]


@pytest.mark.parametrize("dims,program,stages,stage,offset", [m[1:] for m in MASKS], ids=[m[0] for m in MASKS])
def test_a_mask_of_any_offset_is_named_with_its_alignment(tmp_path, dims, program, stages, stage, offset):
    result, report = _check(tmp_path, dims, program, stages, causal=True)
    for d in _assert_named_first(report, stage, "mask_offset"):
        assert d["detail"]["offset"] == offset
        bottom_right = offset == dims.seq_k - dims.seq_q
        assert d["detail"]["bottom_right"] == bottom_right
        assert ("bottom-right aligned (flash-attn's convention)" in d["message"]) == bottom_right


@pytest.mark.parametrize("dims", [WIDE, TALL], ids=["N<M", "N>M"])
def test_the_top_left_mask_passes_wherever_it_is_seen(tmp_path, dims):
    _assert_passes(*_check(tmp_path / "path", dims, _masked(dims, 0), STAGE_PATH, causal=True))
    _assert_passes(*_check(tmp_path / "flash", dims, _flash_masked(dims, 0), ("flash_output",), causal=True))


# ---- the scale 1/d_k ---------------------------------------------------------------------------------

def _used_scale(scale: float):
    return lambda x: bp.scaled_program(x, scale)


def test_a_scale_of_one_over_d_is_named_first_and_as_the_scale_twice_where_they_coincide(tmp_path):
    """With the default scale 1/√d_k, 1/d_k is also the scale applied twice: both are right, the
    scale used named first; the message says the factor's values apart from the two readings."""
    result, report = _check(tmp_path, SQUARE, _used_scale(1 / SQUARE.d_k), STAGE_PATH)
    for d in _assert_named_first(report, "QK_scaled", "scaled"):
        assert d["detail"]["names"][0].startswith("1/d_k used as the scale")
        assert "scale (scale applied twice)" in d["detail"]["names"]
        assert "·want (0.125 = 1/√d_k = scale): 1/d_k used as the scale (divided by d_k, not √d_k), or scale applied " \
            "twice" in d["message"], d["message"]


def test_one_over_d_under_an_explicit_scale_is_not_the_scale_twice(tmp_path):
    result, report = _check(tmp_path, SQUARE, _used_scale(1 / SQUARE.d_k), STAGE_PATH, scale=0.37)
    for d in _assert_named_first(report, "QK_scaled", "scaled"):
        assert d["detail"]["names"][0].startswith("1/d_k used as the scale")
        assert not any("twice" in n for n in d["detail"]["names"])


def test_one_over_d_seen_only_at_the_output_is_named(tmp_path):
    result, report = _check(tmp_path, SQUARE, _used_scale(1 / SQUARE.d_k), ("output",))
    for d in _assert_named_first(report, "output", "scaled"):
        assert d["detail"]["names"][0].startswith("1/d_k used as the scale")
        assert abs(d["detail"]["used_scale"] - 1 / SQUARE.d_k) < 1e-9


def test_one_over_d_is_right_at_d_k_1(tmp_path):
    """At d_k = 1, 1/d_k = 1/√d_k: the program is correct."""
    dims = Dims(1, 2, 16, 24, 1, 1)
    _assert_passes(*_check(tmp_path, dims, _used_scale(1.0), STAGE_PATH))


# ---- the softmax's loops: the mask after it, a key of every tile, the online rescale ---------------

@pytest.mark.parametrize("stages,stage", [(STAGE_PATH, "QK_scaled"), (STAGE_PATH[2:], "attention_weights"),
                                          (("output",), "output")], ids=["stage-path", "weights", "output-only"])
def test_a_mask_applied_after_the_softmax_is_named(tmp_path, stages, stage):
    """The weights softmaxed over every key, then the hidden ones zeroed: where the program wrote its
    (unmasked) scores, their missing mask is the first failing stage; where it wrote none, the weights
    or the output are named for the mask applied after the softmax."""
    scale = default_scale(SQUARE.d_k)
    result, report = _check(tmp_path, SQUARE, lambda x: bp.mask_after_softmax_program(x, scale), stages,
                            causal=True)
    _assert_named_first(report, stage, "mask_missing" if stage == "QK_scaled" else "mask_after_softmax")


def test_a_mask_applied_after_the_softmax_of_other_scores_than_written_is_named(tmp_path):
    """The scores written masked, the weights the softmax of the unmasked ones with the hidden zeroed:
    the weights are named, from the inputs' scores where the written ones hold -inf."""
    scale = default_scale(SQUARE.d_k)
    result, report = _check(tmp_path, SQUARE, lambda x: bp.mask_after_softmax_program(x, scale, masked_scores=True),
                            STAGE_PATH, causal=True)
    _assert_named_first(report, "attention_weights", "mask_after_softmax")


FLASH = ("flash_output", "flash_lse")
ONLINE = [  # (id, dims, the program's options, the stages that fail, the tile named, what the message says)
    ("output-not-rescaled", PAST_TILE, {"rescale_output": False}, ("flash_output",), 32, "running output acc"),
    ("output-not-rescaled-tile-24", PAST_TILE, {"rescale_output": False}, ("flash_output",), 24, "running output acc"),
    ("last-key-skipped-tile-24", SQUARE, {"skip": "last"}, FLASH, 24, "every tile of 24 keys (the partial last"),
    ("sum-not-rescaled", PAST_TILE, {"rescale_sum": False}, FLASH, 32, "running sum l"),
    ("neither-rescaled", SQUARE, {"rescale_sum": False, "rescale_output": False}, FLASH, 32, "neither"),
    ("last-key-skipped", SQUARE, {"skip": "last"}, FLASH, 32, "the last key of every full tile of 32"),
    ("last-key-skipped-tail", PAST_TILE, {"skip": "last"}, FLASH, 32, "(the partial last tile's included)"),
    ("first-key-skipped", PAST_TILE, {"skip": "first"}, FLASH, 32, "the first key of every tile of 32"),
    ("key-tile-skipped", PAST_TILE, {"skip": "tile"}, FLASH, 32, "keys 32..63 (the second tile of 32 keys) are never"),
    # (a tile of 48 keys: not one of the usual widths, no run.toml to say it)
    ("key-tile-skipped-48", SQUARE, {"skip": "tile"}, FLASH, 48, "keys 48..95 (the second tile of 48 keys) are never"),
]
_CODES = {"tile": "key_tile_skipped", "last": "tile_keys_skipped", "first": "tile_keys_skipped"}


@pytest.mark.parametrize("dims,options,failing,tile,words", [o[1:] for o in ONLINE], ids=[o[0] for o in ONLINE])
def test_a_flash_loop_bug_is_named_with_its_tile(tmp_path, dims, options, failing, tile, words):
    scale = default_scale(dims.d_k)
    result, report = _check(tmp_path, dims, lambda x: bp.online_program(x, scale, tile, **options), FLASH)
    code = _CODES[options["skip"]] if "skip" in options else "online_rescale_missing"
    for stage in failing:
        for d in _assert_named_first(report, "flash_output", code) if stage == "flash_output" else \
                [_first(e) for e in _failed(report, stage)]:
            said = "running sum l" if stage == "flash_lse" and code == "online_rescale_missing" else words
            assert d["code"] == code and d["detail"]["tile"] == tile and said in d["message"], d
    assert all(e["status"] != "FAIL" for e in report["results"] if e["stage"] not in failing)


@pytest.mark.parametrize("query_tile, key_tile", [(64, 16), (128, 32), (48, 80)])
def test_a_causal_tile_skip_tested_at_the_query_tiles_first_row_is_named_with_its_tiles(tmp_path, query_tile,
                                                                                       key_tile):
    scale = default_scale(SQUARE.d_k)
    result, report = _check(tmp_path, SQUARE, lambda x: bp.causal_tiles_program(x, scale, query_tile, key_tile, "first"),
                            FLASH, causal=True)
    for stage in FLASH:
        for e in _failed(report, stage):
            d = _first(e)
            assert d["code"] == "causal_tile_skip", e["diagnosis"]
            assert [query_tile, key_tile] in d["detail"]["tilings"], d  # (with the tilings that hide the same keys)
    _assert_passes(*_check(tmp_path / "right", SQUARE, lambda x: bp.causal_tiles_program(x, scale, query_tile, key_tile),
                           FLASH, causal=True))


@pytest.mark.parametrize("route", ["stage-path", "flash", "flash-ftz"])
def test_a_row_maximum_started_at_zero_is_named_where_a_rows_sum_underflows(tmp_path, route):
    """The first causal rows, which see a few keys, given scores below -104 (-95 where the program
    flushes subnormals, as a GPU's fast exp does): exp(s - 0) underflows float32 there, and the
    rows' 0/0 is the bug's, not rows left unwritten."""
    scale = default_scale(SQUARE.d_k)
    if route.startswith("flash"):
        stages, named, ftz = FLASH, FLASH, route == "flash-ftz"
        program = lambda x, bug: bp.online_program(x, scale, TILE, causal=True, max_from=0.0 if bug else -np.inf,  # noqa: E731
                                                   ftz=ftz)
    else:
        stages, named = STAGE_PATH, ("attention_weights",)
        program = lambda x, bug: bp.causal_program(x, scale, bp.max_from_zero_softmax if bug else  # noqa: E731
                                                   bp.stable_softmax)
    in_dir = generate_input(tmp_path / "in", SQUARE, "normal", 7, True)
    inputs = foreign.read_inputs(in_dir, SQUARE.total_heads)
    for h, x in enumerate(inputs):  # rows 0..3 against keys 0..3: scores near -200 (each row's largest -95)
        x["Q"][:4] = -25.0 * x["K"][:4].sum(axis=0)
        if route == "flash-ftz":
            top = np.where(np.tril(np.ones((4, 4), bool)), x["Q"][:4] @ x["K"][:4].T * scale, -np.inf).max(axis=1)
            x["Q"][:4] *= (-95.0 / top)[:, None].astype(np.float32)
        np.savetxt(in_dir / f"Q_head_{h}.txt", x["Q"], fmt="%.9g")
        seen = np.where(np.tril(np.ones((4, 4), bool)), x["Q"][:4] @ x["K"][:4].T * scale, -np.inf)
        assert (seen < (-87.5 if route == "flash-ftz" else -104)).all()
    for bug, out in ((True, "out"), (False, "right")):
        foreign.write_outputs(tmp_path / out, program(inputs, bug), SQUARE, "g9", only=stages)
    result, report = check_folder(tmp_path, in_dir, tmp_path / "out", True, None)
    assert report["first_failing_stage"] == named[0], result.output
    for stage in named:
        for e in _failed(report, stage):
            assert _first(e)["code"] == "running_max_zero" and "rows 0, 1, 2, 3," in _first(e)["message"], \
                [(d["code"], d["message"]) for d in e["diagnosis"]]
    _assert_passes(*check_folder(tmp_path, in_dir, tmp_path / "right", True, None))


def test_the_same_flash_loop_passes(tmp_path):
    scale = default_scale(PAST_TILE.d_k)
    _assert_passes(*_check(tmp_path, PAST_TILE, lambda x: bp.online_program(x, scale, TILE), FLASH))


def test_an_exp2_softmax_without_log2e_is_named_as_the_scale_it_used(tmp_path):
    """exp2 of the scaled scores, log2(e) not folded in: the attention of scale·ln 2, named so on both
    flash stages."""
    scale = default_scale(SQUARE.d_k)
    result, report = _check(tmp_path, SQUARE, lambda x: bp.online_program(x, scale, TILE, fold_log2e=False), FLASH)
    for d in _assert_named_first(report, "flash_output", "scaled") + [_first(e) for e in _failed(report, "flash_lse")]:
        assert d["code"] == "scaled" and abs(d["detail"]["used_scale"] - scale * np.log(2)) < 1e-9, d
        assert "exp2 used without log2(e)" in d["message"], d


def test_a_missing_scale_over_many_keys_is_named_in_every_head():
    """Over 32768 keys the output of a softmax without its scale moves little from the right one
    (its weights spread as thin), less than a hundred of its bounds in some heads; the candidate
    reproduces the program's float32 output to its own rounding, which names it all the same."""
    rng = np.random.default_rng(2)
    q = rng.random((1, 2, 64, 128), dtype=np.float32)
    k, v = (rng.random((1, 2, 32768, 128), dtype=np.float32) for _ in range(2))
    s = np.einsum("bhnd,bhmd->bhnm", q, k)  # (the scale left out), float32
    mx = s.max(axis=-1, keepdims=True)
    p = np.exp(s - mx)
    l = p.sum(axis=-1, keepdims=True)
    out, lse = np.einsum("bhnm,bhmd->bhnd", p / l, v), (mx + np.log(l))[..., 0]
    report = attnstep.check_arrays(q, k, v, {"flash_output": out, "flash_lse": lse})
    for r in report.results:
        assert r.status == "FAIL" and [d.code for d in r.diagnosis][:1] == ["scaled"], (r.stage, r.head, r.diagnosis)
        assert r.diagnosis[0].detail["used_scale"] == 1.0


def _flash_from_a_max_started_at_zero(q, k, v, do, bias, plant_dv: float = 0.0):
    """A float32 flash forward whose row maximum starts at 0 (rows whose scores all lie far below 0
    end with l = 0: output 0, lse = -inf), and a FlashAttention-2 backward from its own output and
    lse that takes an lse of -inf as a row without weight (P = 0 there, as for flash-attn's +inf)."""
    f32, scale = np.float32, np.float32(q.shape[-1] ** -0.5)
    out = {n: np.zeros(x.shape, f32) for n, x in (("flash_output", q), ("flash_dQ", q), ("flash_dK", k),
                                                  ("flash_dV", v))}
    out["flash_lse"] = np.zeros(q.shape[:-1], f32)
    for h in range(q.shape[1]):
        Q, K, V, dO = q[0, h], k[0, h], v[0, h], do[0, h]
        S = (Q @ K.T) * scale + bias
        m = np.maximum(f32(0), S.max(axis=1))
        p = np.exp(S - m[:, None])
        l = p.sum(axis=1, dtype=f32)
        with np.errstate(divide="ignore"):
            lse = (m + np.log(l)).astype(f32)
        O = np.where(l[:, None] > 0, (p @ V) / np.where(l > 0, l, 1)[:, None], 0).astype(f32)
        P = np.exp(S - np.where(np.isneginf(lse), np.inf, lse)[:, None]).astype(f32)
        dS = P * (dO @ V.T - (dO * O).sum(axis=1, dtype=f32)[:, None])
        out["flash_output"][0, h], out["flash_lse"][0, h], out["flash_dV"][0, h] = O, lse, P.T @ dO
        out["flash_dQ"][0, h], out["flash_dK"][0, h] = (dS @ K) * scale, (dS.T @ Q) * scale
    out["flash_dV"][0, 0, 3, 2] += np.float32(plant_dv)
    return out


@pytest.mark.parametrize("plant_dv", [0.0, 1e-3])
def test_gradients_from_a_max_started_at_zero_inherit_its_lse(plant_dv):
    """The flash gradients computed right from a forward whose lse is -inf in rows that see keys
    (the row maximum started at 0): the lse says those rows hold no weight, so the gradients' check
    from the program's own lse gives them none (not exp(S + inf), a NaN reference): INHERITED; a
    gradient wrong on its own still fails."""
    rng = np.random.default_rng(3)
    q, do = (rng.standard_normal((1, 2, 40, 32)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, 2, 56, 32)).astype(np.float32) for _ in range(2))
    bias = np.zeros((40, 56), np.float32)
    bias[5:9] -= 150  # rows 5..8: every score below -104, exp(s - 0) underflows
    report = attnstep.check_arrays(q, k, v, _flash_from_a_max_started_at_zero(q, k, v, do, bias, plant_dv), do=do,
                                   attn_bias=bias)
    status = {(r.stage, r.head): r for r in report.results}
    assert report.first_failing_stage == "flash_output"
    for h in range(2):
        for stage in ("flash_dQ", "flash_dK", "flash_dV"):
            r = status[stage, h]
            want = "FAIL" if plant_dv and (stage, h) == ("flash_dV", 0) else "INHERITED"
            assert r.status == want and np.isfinite(r.isolated.want), (stage, h, r.status, r.isolated.want)


def test_d_from_a_wrong_flash_output_is_inherited_in_a_flash_only_program():
    """A FlashAttention-2 backward computes D = rowsum(dO * O) from its own flash_output: where the
    forward is wrong (the scale left out here) and the program wrote no `output`, D is computed
    right from what it was given: INHERITED, not a second bug."""
    rng = np.random.default_rng(4)
    q, k, v, do = (rng.standard_normal((1, 2, 48, 32)).astype(np.float32) for _ in range(4))
    heads = [foreign.flash_forward(q[0, h], k[0, h], v[0, h], 1.0, True, 16, False) for h in range(2)]
    out = np.stack([o for o, _ in heads])[None]
    lse = np.stack([x[:, 0] for _, x in heads])[None]
    d = (do * out).sum(axis=-1)
    report = attnstep.check_arrays(q, k, v, {"flash_output": out, "flash_lse": lse, "D": d}, do=do, causal=True)
    assert report.first_failing_stage == "flash_output"
    for r in report.results:
        if r.stage == "D":
            assert r.status == "INHERITED" and "flash_output" in r.message, (r.status, r.message)


@pytest.mark.parametrize("bug, stage, code", [
    ("lse is the max", "flash_lse", "lse_sum_missing"),
    ("lse is log l", "flash_lse", "lse_max_missing"),
    ("output not divided by l", "flash_output", "softmax_unnormalized"),
    ("weights not divided by l", "attention_weights", "softmax_unnormalized"),
])
def test_a_softmax_without_a_part_of_its_normalization_is_named(bug, stage, code):
    """A kernel's last step left out: the output (or the weights) not divided by the row sum l, or
    the lse = max + log l without one of its terms."""
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 2, 40, 32)).astype(np.float32) for _ in range(3))
    s = np.einsum("bhnd,bhmd->bhnm", q, k) * np.float32(32 ** -0.5)
    s = np.where(np.tril(np.ones((40, 40), bool)), s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    p = np.exp(s - mx)
    l = p.sum(axis=-1, keepdims=True)
    stages = {"flash_output": np.einsum("bhnm,bhmd->bhnd", p / l, v), "flash_lse": (mx + np.log(l))[..., 0],
              "attention_weights": p / l}
    wrong = {"lse is the max": mx[..., 0], "lse is log l": np.log(l)[..., 0],
             "output not divided by l": np.einsum("bhnm,bhmd->bhnd", p, v), "weights not divided by l": p}[bug]
    report = attnstep.check_arrays(q, k, v, {stage: wrong}, causal=True)
    assert report.first_failing_stage == stage
    for r in report.results:
        assert [d.code for d in r.diagnosis][:1] == [code], [(d.code, d.message) for d in r.diagnosis]
    assert attnstep.check_arrays(q, k, v, {stage: stages[stage]}, causal=True).passed


def _softmax_rows(s: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        return np.nan_to_num(e / e.sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("bug, n, m, stage", [
    ("columns", 40, 40, "flash_output"), ("columns", 40, 40, "flash_lse"), ("columns", 24, 56, "output"),
    ("swapped", 24, 56, "flash_output"), ("swapped", 24, 56, "attention_weights"),
])
def test_a_softmax_along_the_wrong_axis_is_named_in_what_follows_it(bug, n, m, stage):
    """Weights normalized over the queries (each column's softmax; a square head's lse over each
    column), or a softmax launched with its row length and row count swapped over the N×M buffer
    (rows of N, not M): named in the one stage the program wrote. The right axis passes."""
    rng = np.random.default_rng(9)
    q = rng.standard_normal((1, 2, n, 32)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, m, 32)).astype(np.float32) for _ in range(2))
    s = np.einsum("bhnd,bhmd->bhnm", q, k).astype(np.float64) * 32 ** -0.5
    s = np.where(np.tril(np.ones((n, m), bool), m - n), s, -np.inf)
    if bug == "columns":
        p, lse = np.swapaxes(_softmax_rows(np.swapaxes(s, 2, 3)), 2, 3), np.logaddexp.reduce(s, axis=2)
    else:
        p, lse = _softmax_rows(s.reshape(1, 2, m, n)).reshape(s.shape), None
    wrong = {"attention_weights": p, "flash_output": p @ v, "output": p @ v, "flash_lse": lse}[stage]
    right = {"attention_weights": _softmax_rows(s), "flash_lse": np.logaddexp.reduce(s, axis=3)}.get(
        stage, _softmax_rows(s) @ v)
    report = attnstep.check_arrays(q, k, v, {stage: wrong.astype(np.float32)}, causal="bottom-right")
    assert report.first_failing_stage == stage
    for r in report.results:
        assert [d.code for d in r.diagnosis][:1] == ["softmax_axis"], [(d.code, d.message) for d in r.diagnosis]
    assert attnstep.check_arrays(q, k, v, {stage: right.astype(np.float32)}, causal="bottom-right").passed


def _flash_heads(q, k, v, do, lse_head=lambda h: h, route=foreign.BackwardRoute()):
    """A float32 FlashAttention-2 forward and backward per head (tests/helpers/foreign_routes.py),
    the backward of head h recomputing P against head lse_head(h)'s lse."""
    H, scale = q.shape[1], default_scale(q.shape[-1])
    fwd = [foreign.flash_forward(q[0, h], k[0, h], v[0, h], scale, False, 32, False) for h in range(H)]
    bwd = [foreign.flash_backward(q[0, h], k[0, h], v[0, h], do[0, h], fwd[h][0], fwd[lse_head(h)][1], scale, False,
                                  route) for h in range(H)]
    out = {"flash_output": np.stack([o for o, _ in fwd])[None], "flash_lse": np.stack([x[:, 0] for _, x in fwd])[None]}
    return {**out, **{n: np.stack([b[n] for b in bwd])[None] for n in ("flash_dQ", "flash_dK", "flash_dV")}}


def test_a_flash_backward_reading_the_next_head_s_lse_is_named():
    """The backward of head h recomputes P against head h + 1's lse (its offset into the saved lse
    off by one head): named with the head it read, the forward right."""
    rng = np.random.default_rng(12)
    q, k, v, do = (rng.standard_normal((1, 3, 40, 32)).astype(np.float32) for _ in range(4))
    stages = _flash_heads(q, k, v, do, lse_head=lambda h: (h + 1) % 3)
    report = attnstep.check_arrays(q, k, v, stages, do=do)
    assert report.first_failing_stage == "flash_dQ", attnstep.format_report(report)
    for r in (r for r in report.results if r.stage == "flash_dQ"):
        d = r.diagnosis[0]
        assert d.code == "lse_wrong_head" and d.detail["read_head"] == (r.head + 1) % 3, (d.code, d.message)


@pytest.mark.parametrize("keys", [90, 96])
def test_the_last_key_row_of_every_tile_left_out_of_dk_and_dv_is_named(keys):
    """dK and dV never accumulated at the last key row of each 32-key tile: with M = 90 the partial
    last tile's own last row (89) too. Named as the tile pattern it is, whether or not M is a
    multiple of the tile."""
    rng = np.random.default_rng(13)
    q, do = (rng.standard_normal((1, 2, 64, 32)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, 2, keys, 32)).astype(np.float32) for _ in range(2))
    stages = _flash_heads(q, k, v, do, route=foreign.BackwardRoute(flash="exp-32"))
    left_out = [r for r in range(keys) if r % 32 == 31 or r == keys - 1]
    for name in ("flash_dK", "flash_dV"):
        stages[name][0, :, left_out] = 0.0
    report = attnstep.check_arrays(q, k, v, stages, do=do)
    assert report.first_failing_stage == "flash_dK", attnstep.format_report(report)
    for r in (r for r in report.results if r.stage in ("flash_dK", "flash_dV")):
        d = r.diagnosis[0]
        assert d.code == "tile_boundary" and d.detail["period"] == 32, (d.code, d.message)
        assert d.detail["lines"] == left_out, d.detail


@pytest.mark.parametrize("operand", ["K", "V"])
def test_one_operand_read_from_the_next_head_is_named(operand):
    """K (or V) read at the next head's offset, the other operand at the head's own: named with the
    operand and the head it read."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, 3, 40, 32)).astype(np.float32) for _ in range(3))
    out = []
    for h in range(3):
        kk, vv = (k[0, (h + 1) % 3], v[0, h]) if operand == "K" else (k[0, h], v[0, (h + 1) % 3])
        s = (q[0, h] @ kk.T) * np.float32(32 ** -0.5)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out.append((p / p.sum(axis=1, keepdims=True)) @ vv)
    report = attnstep.check_arrays(q, k, v, {"flash_output": np.stack(out)[None]})
    for r in report.results:
        d = r.diagnosis[0]
        assert d.code == "operand_head" and d.detail["operand"] == operand, [(x.code, x.message) for x in r.diagnosis]
        assert d.detail["read_head"] == (r.head + 1) % 3


# ---- a finite stand-in for -inf ------------------------------------------------------------------

STAND_INS = [-1e9, -65504.0, -1e4, float(np.finfo(np.float32).min)]


@pytest.mark.parametrize("writer", ["g9", "g6"])
@pytest.mark.parametrize("fill", STAND_INS)
def test_scores_masked_with_a_finite_stand_in_pass(tmp_path, fill, writer):
    """masked_fill(-1e9) and its kin, printed %.9g or %g: its exponential is 0 in float32, the
    weights those of -inf."""
    scale = default_scale(WIDE.d_k)
    _assert_passes(*_check(tmp_path, WIDE, lambda x: bp.masked_program(x, scale, 0, fill), STAGE_PATH, causal=True,
                           writer=writer))


def test_a_mask_value_too_near_the_scores_fails_and_says_how_far_a_stand_in_lies(tmp_path):
    scale = default_scale(WIDE.d_k)
    result, report = _check(tmp_path, WIDE, lambda x: bp.masked_program(x, scale, 0, -50.0), STAGE_PATH, causal=True)
    for d in _assert_named_first(report, "QK_scaled", "mask_missing"):
        assert "no entry it hides holds the masked value -inf" in d["message"], d
        assert "at least 104 below the row's largest visible score" in d["message"], d


@pytest.mark.parametrize("offset", [1, -1])
def test_a_stand_in_mask_at_another_offset_is_named_with_its_offset(tmp_path, offset):
    scale = default_scale(TALL.d_k)
    result, report = _check(tmp_path, TALL, lambda x: bp.masked_program(x, scale, offset, -1e9), STAGE_PATH,
                            causal=True)
    for d in _assert_named_first(report, "QK_scaled", "mask_offset"):
        assert d["detail"]["offset"] == offset


@pytest.mark.parametrize("fill", [-1e9, -2000.0])
def test_a_row_of_stand_ins_is_the_weights_failure_said_so(tmp_path, fill):
    """Bottom-right with N > M leaves the first rows no key: a softmax over a row of -1e9 weighs every
    key alike, where the weights are 0. The scores are right (a stand-in in every entry of the row);
    the weights fail, and say why."""
    scale = default_scale(TALL.d_k)
    offset = TALL.seq_k - TALL.seq_q  # bottom-right: rows 0..31 see no key
    in_dir = generate_input(tmp_path / "in", TALL, "normal", 7, False)
    heads = bp.masked_program(foreign.read_inputs(in_dir, TALL.total_heads), scale, offset, fill)
    foreign.write_outputs(tmp_path / "out", heads, TALL, "g9", only=STAGE_PATH)
    result = invoke("check", "--in", in_dir, "--out", tmp_path / "out", "--causal", "bottom-right", "--json",
                    tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["first_failing_stage"] == "attention_weights", result.output
    for entry in _failed(report, "attention_weights"):
        d = _first(entry)
        assert d["code"] == "mask_missing" and "hiding every key" in d["message"], d


@pytest.mark.parametrize("fill", [-1e9, float(np.finfo(np.float32).min)])
def test_a_row_of_stand_ins_beside_an_lse_of_minus_inf_passes(tmp_path, fill):
    """The scores of a row that sees no key held as stand-ins, and that row's flash_lse -inf (log 0,
    the contract's value): the log-sum-exp of the scores' row is log 0 as well, not fill + log M."""
    scale = default_scale(TALL.d_k)
    offset = TALL.seq_k - TALL.seq_q  # bottom-right: rows 0..31 see no key
    in_dir = generate_input(tmp_path / "in", TALL, "normal", 7, False)
    inputs = foreign.read_inputs(in_dir, TALL.total_heads)
    heads = bp.masked_program(inputs, scale, offset, fill)
    for h, x in zip(heads, inputs):
        s = np.where(np.isfinite(h["QK_scaled"]) & (h["QK_scaled"] > -1e3), h["QK_scaled"], -np.inf).astype(np.float64)
        lse = np.logaddexp.reduce(s, axis=1, keepdims=True)
        with np.errstate(invalid="ignore"):  # (−inf − −inf in the rows that see no key: 0 weights there)
            weights = np.nan_to_num(np.exp(s - lse))
        h["flash_lse"], h["attention_weights"] = lse.astype(np.float32), weights.astype(np.float32)
        h["flash_output"] = weights @ x["V"].astype(np.float64)
        h["output"] = h["flash_output"].astype(np.float32)
    foreign.write_outputs(tmp_path / "out", heads, TALL, "g9", only=STAGE_PATH + FLASH)
    result = invoke("check", "--in", in_dir, "--out", tmp_path / "out", "--causal", "bottom-right", "--json",
                    tmp_path / "r.json")
    _assert_passes(result, json.loads((tmp_path / "r.json").read_text()))


def _skipping_keys(keys):
    """A flash program whose key loop leaves out the given keys (and nothing else)."""
    def program(inputs):
        out = []
        for x in inputs:
            kept = np.setdiff1d(np.arange(x["K"].shape[0]), list(keys))
            o, lse = foreign.flash_forward(x["Q"], x["K"][kept], x["V"][kept], default_scale(x["Q"].shape[1]), False,
                                           64, True)
            out.append({"flash_output": o, "flash_lse": lse})
        return out
    return program


@pytest.mark.parametrize("dims,keys", [(Dims(1, 4, 1, 200, 64, 64), {0}), (Dims(1, 4, 1, 130, 64, 64), {65}),
                                       (Dims(1, 2, 64, 130, 32, 32), {128, 129})],
                         ids=["decode-first-key", "decode-middle-key", "keys-past-the-last-tile"])
def test_keys_left_out_otherwise_are_no_tile_pattern(tmp_path, dims, keys):
    """A decode step's one row leaves the keys it weighs little free to fit some tiling, and the keys
    past the last full tile are keys_dropped's: no tile_keys_skipped is named for either."""
    result, report = _check(tmp_path, dims, _skipping_keys(keys), FLASH)
    assert report["first_failing_stage"] == "flash_output", result.output
    named = {d["code"] for e in report["results"] for d in e["diagnosis"]}
    assert "tile_keys_skipped" not in named, result.output


def _bf16(x: np.ndarray) -> np.ndarray:
    from verify.model.half import round_to_format32
    return round_to_format32(np.asarray(x, np.float32), "bf16")


def test_the_tile_searches_recompute_few_whole_stages_over_many_keys(monkeypatch):
    """A bf16 output with a key tile skipped, over 2048 keys: the loops' searches (every tile width
    from 2 to 256, three readings each) recompute the whole stage only for the readings whose
    sampled rows could still be told from the reference, not for every tiling whose left-out keys
    weigh too little to move those rows; the bug is named as before."""
    from verify.diagnose import softmax_loops
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, n, 64)).astype(np.float32) for n in (64, 2048, 2048))
    s = (_bf16(q[0]) @ _bf16(k[0]).T) / 8.0
    s[:, 64:128] = -np.inf
    p = np.exp(s - s.max(axis=1, keepdims=True))
    out = _bf16((_bf16(p / p.sum(axis=1, keepdims=True)) @ _bf16(v[0]))[None])
    whole = []
    real_stage, real_online = softmax_loops._Head.softmax_stage, softmax_loops._online
    monkeypatch.setattr(softmax_loops._Head, "softmax_stage", lambda self, logits, rows=slice(None): (
        whole.append(1) if isinstance(rows, slice) else None) or real_stage(self, logits, rows))
    monkeypatch.setattr(softmax_loops, "_online", lambda head, tile, a, b, rows=slice(None): (
        whole.append(1) if isinstance(rows, slice) else None) or real_online(head, tile, a, b, rows))
    report = attnstep.check_arrays(q, k, v, {"flash_output": out}, precision="bf16")
    failed = [r for r in report.results if r.status == "FAIL"]
    assert failed and all(r.diagnosis[0].code == "key_tile_skipped" for r in failed), \
        [(r.stage, [d.message for d in r.diagnosis]) for r in failed]
    assert len(whole) <= 10, len(whole)


def test_a_cause_named_only_on_a_later_stage_is_in_the_verdict():
    """A bf16 flash forward whose causal mask lets each row see one key past the diagonal, over 1024
    keys: its output's own rounding hides the mask among the output's widths (no name), its float32
    lse does not (mask_offset); the verdict line, on the output, says what the lse names."""
    rng = np.random.default_rng(0)
    n, m = 128, 1024
    q, k, v = (rng.standard_normal((2, x, 64)).astype(np.float32) for x in (n, m, m))
    out, lse = [], []
    for h in range(2):
        s = (_bf16(q[h]) @ _bf16(k[h]).T) / 8.0
        s = np.where(np.arange(m)[None, :] <= np.arange(n)[:, None] + m - n + 1, s, -np.inf)
        mx = s.max(axis=1, keepdims=True)
        p = np.exp(s - mx)
        out.append(_bf16(_bf16(p / p.sum(axis=1, keepdims=True)) @ _bf16(v[h])))
        lse.append((mx + np.log(p.sum(axis=1, keepdims=True)))[:, 0].astype(np.float32))
    report = attnstep.check_arrays(q, k, v, {"flash_output": np.stack(out), "flash_lse": np.stack(lse)},
                                   precision="bf16", causal="bottom-right")
    codes = {(r.stage, r.head): [d.code for d in r.diagnosis] for r in report.results if r.status == "FAIL"}
    assert codes[("flash_lse", 0)][:1] == ["mask_offset"], codes
    verdict = [line for line in attnstep.format_report(report).splitlines() if "first failing stage" in line]
    assert verdict and "first failing stage: flash_output" in verdict[0], verdict
    if not codes[("flash_output", 0)]:
        assert "flash_lse, failing on the same head, names mask_offset" in verdict[0], verdict
    else:  # (named on the output itself: the verdict says that name)
        assert "mask_offset" in verdict[0], verdict
