"""The flash stages' references and error model in query-row tiles (verify/model/tiles.py).

* Row tiles of a head's variant (HeadVariant.rows_of) answer what the whole head holds in those
  rows: the mask, the window, both causal alignments, ALiBi's distances and flash-attn's causal
  shift, the mask, bias and keep-mask files' rows.
* Tiled and whole-head references and bounds of flash_output, flash_lse, flash_dQ, flash_dK,
  flash_dV (chained, isolated, printed resolution, floors, the dK column-sum check) agree to 1e-12
  on random small cases of every variant, with tiles smaller than N (and tails), on the CPU's and
  the GPU kernels' arithmetic. The tiles run with the dot products' expected-variance model, which
  the whole head takes above dot.ENERGY_EXACT_MAX_MACS (lowered here so that small heads take it).
* The passes over the tiles are shared as the check shares them (the forward's bounds from the
  backward chain's pass, a gradient's isolated reference from its isolated bound's pass) with the
  same results; no pass of the forward's own runs then, and one of the gradients' references.
* On several threads (tiles.tile_workers) the tiles give the same references and bounds bit for
  bit as on one, even where the later tiles are computed first: their sums over the query rows and
  their lists of rows add in tile order (tiles.in_order). The check itself runs them on the cores.
* The backward chain's floors for flushed products: a pass that leaves out their sums gives the
  bounds of one that computes them where no product can be tiny, and hands over to such a pass
  where a later tile's entries could make one (the same bounds, bit for bit, both ways).
* A head that takes the exact model, or fits in one tile, is one tile (the whole head, as before);
  a run that writes or reads an N×M stage is sized as an untiled one (sizing.tiled_run).
* Memory: the chained and isolated bounds of a flash forward and backward at N = 2048, M = 1024 never
  hold one N×M float64 matrix (tracemalloc's peak stays below one), where the whole head's exceed
  it many times.
* The check engine gives the same report, tiled or not, on a flash run of the CPU binary (grouped
  K/V heads, variants, split keys, packed sequences, a paged cache).
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import tracemalloc

import numpy as np
import pytest

from helpers.cli import invoke
from helpers.reports import assert_same_report
from verify.check import compare, pool, sizing, tolerance
from verify.check.reference import compute_stage, reference_chain
from verify.cli import check as check_cli
from verify.files.case import load_input_case
from verify.files.outputs import open_run
from verify.model import dot, tiles
from verify.model.scores import HeadVariant
from verify.specs import SPECS, sources_of
from verify.specs import flash as flash_spec
from verify.model.kernels import kernel_for
from verify.model.rounding import FLUSH
from verify.specs.backward import flash_bounds, flash_chain_pass, flash_tiles
from verify.stages import FLASH_GRAD_KEYS, FLASH_GRAD_QUERIES, FLASH_GRAD_VALUES, FLASH_LSE, FLASH_OUTPUT, STAGES, Dims
from verify.variant import BOTTOM_RIGHT, PER_HEAD, Variant

FLASH = (FLASH_OUTPUT, FLASH_LSE, FLASH_GRAD_QUERIES, FLASH_GRAD_KEYS, FLASH_GRAD_VALUES)
SCALE = 0.3
RTOL = 1e-12

VARIANTS = {
    "plain": (Variant(), 0.0),
    "causal": (Variant(causal=True), 0.0),
    "bottom-right-alibi": (Variant(causal=True, align=BOTTOM_RIGHT, alibi=True), 0.25),
    "window-softcap": (Variant(window=(7, 3), softcap=1.5), 0.0),
    "mask-bias": (Variant(mask=PER_HEAD, bias=PER_HEAD), 0.0),
    "dropout": (Variant(dropout=0.2), 0.0),
}
KERNELS = {"cpu": {}, "gpu-fast-tf32": dict(backend="cuda", flash_kernel="cuda-fast-tf32")}
KERNELS_CPU = kernel_for("cpu", "ieee", None)


def _inputs(variant: Variant, n: int, m: int, d: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = {"Q": rng.normal(size=(n, d)), "K": rng.normal(size=(m, d)), "V": rng.normal(size=(m, d)),
         "dO": rng.normal(size=(n, d))}
    if variant.mask != "none":
        mask = (rng.random((n, m)) < 0.8).astype(np.float64)
        mask[:, 0], mask[3] = 1, 0  # and a row that sees no key
        x["mask"] = mask
    if variant.bias != "none":
        bias = rng.normal(size=(n, m))
        bias[5, 2:9] = -np.inf
        x["bias"] = bias
    if variant.dropout > 0:
        x["dropout_mask"] = (rng.random((n, m)) > variant.dropout).astype(np.float64)
    return x


def _everything(variant: Variant, slope: float, x, kernel, shared: bool = False) -> dict:
    """Every flash stage's chained reference and bound, isolated reference and bound (from the
    chain rounded to float32, as a program's upstream files), and printed-resolution move;
    shared: the forward's bounds and every chained reference from the backward chain's pass, the
    gradients' isolated references from their isolated bounds' pass (as the check takes them)."""
    args = dict(scale=SCALE, causal=variant.causal, variant=variant, slope=slope, **kernel)
    chain = reference_chain(x, SCALE, variant.causal, FLASH, variant=variant, slope=slope)
    full, cache, out = {**x, **chain}, tolerance.HeadCache(), {}
    if shared:
        tolerance.share_flash_passes(FLASH_OUTPUT, full, cache=cache, **args)
    refs = tolerance.chained_flash_references(full, cache=cache, **args) if shared else chain
    for st in FLASH:
        out[st + " ref"] = refs[st]
        out[st + " chained"] = tolerance.chained_bound(st, full, cache=cache, **args)
    got = {k: v.astype(np.float32).astype(np.float64) if k in chain else v for k, v in full.items()}
    for st in FLASH:
        src = {n: got[n] for n in sources_of(st, variant) + ("mask", "bias", "dropout_mask") if n in got}
        if shared:
            tolerance.share_flash_references(st, src, cache=cache, **args)
        ref = compute_stage(st, src, SCALE, variant.causal, variant=variant, slope=slope)
        out[st + " isolated ref"] = ref
        out[st + " isolated"] = tolerance.stage_bound(st, src, ref, cache=cache, **args)
        quanta = {n: np.full(np.shape(src[n]), 1e-7) for n in ("Q", "K", FLASH_OUTPUT, FLASH_LSE) if n in src}
        out[st + " moved"] = np.asarray(tolerance.quantization_bound(st, src, quanta, SCALE, variant.causal,
                                                                     variant=variant, slope=slope))
        out[st + " floor"] = np.asarray(SPECS[st].floor(src), np.float64)
    return out


def _agree(whole: dict, tiled: dict) -> None:
    for key, a in whole.items():
        a, b = np.broadcast_arrays(a, tiled[key])
        assert ((a == b) | np.isfinite(a) & np.isfinite(b) | np.isnan(a) & np.isnan(b)).all(), key
        fin = np.isfinite(a) & np.isfinite(b)
        if key.endswith("ref"):  # normwise: a gradient summed over other rows may cancel
            tol = RTOL * max(np.max(np.abs(a[fin]), initial=0.0), 1e-300)
        else:                    # a bound, element by element
            tol = RTOL * np.abs(a[fin])
        assert (np.abs(a[fin] - b[fin]) <= tol).all(), (key, np.max(np.abs(a[fin] - b[fin])))


@pytest.fixture
def expected_model(monkeypatch):
    """Small heads take the expected-variance model of a large one (as above the limit)."""
    monkeypatch.setattr(dot, "ENERGY_EXACT_MAX_MACS", 10)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("n,m,rows", [(77, 53, 8), (40, 96, 16), (33, 20, 32)], ids=lambda v: str(v))
def test_tiles_agree_with_the_whole_head(name, kernel, n, m, rows, monkeypatch, expected_model):
    variant, slope = VARIANTS[name]
    x = _inputs(variant, n, m, seed=n + len(name))
    monkeypatch.setattr(tiles, "TILE_BYTES", 1 << 40)
    assert tiles.row_tiles(n, m, 16) == [(0, n)]
    whole = _everything(variant, slope, x, KERNELS[kernel])
    monkeypatch.setattr(tiles, "TILE_BYTES", 8 * m * rows)
    cut = tiles.row_tiles(n, m, 16)
    assert len(cut) > 1 and cut[-1][1] == n and all(a % 8 == 0 for a, _ in cut)
    _agree(whole, _everything(variant, slope, x, KERNELS[kernel], shared=True))  # (as the check shares its passes)


class _LastFirst:
    """An executor that computes the tiles handed to it last first (all of them, when a result is
    first asked for): what threads may do, at its most out of order."""

    def __init__(self, workers: int) -> None:
        self.waiting: list = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.run()

    def submit(self, fn, *args):
        later = _Later(self, lambda: fn(*args))
        self.waiting.append(later)
        return later

    def run(self) -> None:
        waiting, self.waiting = self.waiting, []
        for later in reversed(waiting):
            later.value = later.compute()


class _Later:
    def __init__(self, pool: _LastFirst, compute) -> None:
        self.pool, self.compute, self.value = pool, compute, None

    def result(self):
        if self.value is None:
            self.pool.run()
        return self.value


def _same_bits(a: dict, b: dict) -> None:
    for key, x in a.items():
        assert np.array_equal(np.asarray(x), np.asarray(b[key]), equal_nan=True), key


@pytest.mark.parametrize("order", ["threads", "last-first"])
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("name", ["causal", "window-softcap", "dropout"])
def test_tiles_on_threads_give_one_threads_bits(name, kernel, order, monkeypatch, expected_model):
    variant, slope = VARIANTS[name]
    x = _inputs(variant, 77, 53, seed=len(name))
    monkeypatch.setattr(tiles, "TILE_BYTES", 8 * 53 * 8)
    one = _everything(variant, slope, x, KERNELS[kernel], shared=True)
    if order == "last-first":
        monkeypatch.setattr(tiles, "ThreadPoolExecutor", _LastFirst)
    with tiles.tile_workers(4):
        _same_bits(one, _everything(variant, slope, x, KERNELS[kernel], shared=True))


def test_the_check_runs_a_heads_tiles_on_the_cores(monkeypatch):
    """attnstep's own process checking one head at a time: its tiles on a thread a core, BLAS on
    one thread of its own within them (restored after)."""
    monkeypatch.setattr(pool, "_usable_cores", lambda: 3)
    seen = []
    assert pool.map_heads(lambda h: seen.append(tiles._WORKERS.get()[0]) or [h], 2, 1, tune_process=True) == [0, 1]
    assert seen == [3, 3] and tiles._WORKERS.get()[0] == 1
    assert pool.map_heads(lambda h: seen.append(tiles._WORKERS.get()[0]) or [h], 1, 1) == [0]
    assert seen[-1] == 1  # (the Python API's: the caller's process, untouched)


def _arrays(x):
    """Every array in a nest of tuples, in order."""
    if isinstance(x, tuple):
        return [a for part in x for a in _arrays(part)]
    return [np.asarray(x)]


@pytest.mark.parametrize("tiny", [False, True], ids=["normal", "tiny-last-rows"])
def test_the_chain_computes_the_floors_sums_only_where_they_count(tiny, monkeypatch, expected_model):
    variant = Variant()
    x = _inputs(variant, 77, 53, seed=3)
    if tiny:  # the last tile's dS (dO's rows) near float32's normal range, the earlier tiles' not
        x["dO"][72:] *= 1e-33
    monkeypatch.setattr(tiles, "TILE_BYTES", 8 * 53 * 8)
    args = (x["Q"], x["K"], x["V"], x["dO"], SCALE, HeadVariant(variant), 2.0**-24, KERNELS_CPU, None)
    passes = []
    chain_pass = flash_chain_pass._chain_pass
    monkeypatch.setattr(flash_chain_pass, "_chain_pass",
                        lambda *a, floors, own=None: passes.append(floors) or chain_pass(*a, floors=floors, own=own))
    with tiles.tile_workers(2):
        lazy = flash_chain_pass._chain(*args)
    assert passes == ([False, True] if tiny else [False])
    full = chain_pass(*args, floors=True)
    for a, b in zip(_arrays(tuple(lazy[0]) + lazy[1]), _arrays(tuple(full[0]) + full[1])):
        assert np.array_equal(a, b, equal_nan=True)
    assert bool(np.any(lazy[0].floors[0] != 0)) == tiny  # (dQ's floor: G·K's tiny products)


@pytest.mark.parametrize("tile_bytes", [1 << 40, 8 * 53 * 8], ids=["whole", "tiled"])
def test_the_passes_over_the_tiles_are_shared(tile_bytes, monkeypatch, expected_model):
    """With a flash backward stage in the chain, the forward's bounds are taken from the chain's
    pass over the row tiles: no pass of the forward's own (which would compute every tile's logits
    and softmax again) runs; the gradients' isolated references come from their isolated bounds'
    pass: one pass of the references' own (the chain's), not two. The same references and bounds."""
    variant, slope = VARIANTS["causal"]
    x = _inputs(variant, 77, 53)
    monkeypatch.setattr(tiles, "TILE_BYTES", tile_bytes)
    own = _everything(variant, slope, x, {})

    def no_pass(*args):
        raise AssertionError("the flash forward's own pass ran")
    monkeypatch.setattr(flash_spec, "flash_forward_rows", no_pass)
    passes, gradients = [], flash_tiles._gradients
    monkeypatch.setattr(flash_tiles, "_gradients", lambda *a: passes.append(1) or gradients(*a))
    _agree(own, _everything(variant, slope, x, {}, shared=True))
    assert len(passes) == 1  # the chained reference's
    with pytest.raises(AssertionError, match="own pass ran"):
        _everything(variant, slope, x, {})


def test_a_tile_that_ignored_its_rows_would_be_caught(monkeypatch, expected_model):
    """The comparison above can fail: tiles of a causal head that forget where they lie."""
    variant, slope = VARIANTS["causal"]
    x = _inputs(variant, 77, 53)
    monkeypatch.setattr(tiles, "TILE_BYTES", 1 << 40)
    whole = _everything(variant, slope, x, {})
    monkeypatch.setattr(tiles, "TILE_BYTES", 8 * 53 * 8)
    real = HeadVariant.rows_of

    def forgetful(self, start, stop, n):
        tile = real(self, start, stop, n)
        tile.origin = (0, stop - start)  # each tile taken for a head of its own
        return tile
    monkeypatch.setattr(HeadVariant, "rows_of", forgetful)
    with pytest.raises(AssertionError):
        _agree(whole, _everything(variant, slope, x, {}))


@pytest.mark.parametrize("name", ["causal", "mask-bias"])
def test_the_lse_reference_comes_from_the_output_references_pass(name, monkeypatch):
    """The chain's flash_lse reference is the one flash_output's pass computed from the same tiles'
    scores (no pass of its own), and equal to its own pass's."""
    variant, slope = VARIANTS[name]
    x = _inputs(variant, 77, 53)
    monkeypatch.setattr(tiles, "TILE_BYTES", 8 * 53 * 8)
    own = compute_stage(FLASH_LSE, {k: v for k, v in x.items() if k != "V"}, SCALE, variant.causal,
                        variant=variant, slope=slope)
    passes, lse = [], flash_spec._with_mask_lse
    monkeypatch.setattr(flash_spec, "_with_mask_lse", lambda *a, **k: passes.append(1) or lse(*a, **k))
    chain = reference_chain(x, SCALE, variant.causal, (FLASH_OUTPUT, FLASH_LSE), variant=variant, slope=slope)
    assert not passes
    np.testing.assert_array_equal(chain[FLASH_LSE], own)


@pytest.mark.parametrize("name", ["causal", "bottom-right-alibi", "window-softcap", "mask-bias", "dropout"])
def test_a_row_tile_of_a_head_variant_is_those_rows_of_the_head(name):
    variant, slope = VARIANTS[name]
    n, m = 23, 31
    x = _inputs(variant, n, m, seed=3)
    head = HeadVariant(variant, slope, x.get("mask"), x.get("bias"), x.get("dropout_mask"))
    scaled = np.random.default_rng(1).normal(size=(n, m))
    for a, b in [(0, 8), (8, 16), (16, 23)]:
        tile = head.rows_of(a, b, n)
        np.testing.assert_array_equal(tile.hidden(b - a, m), head.hidden(n, m)[a:b])
        np.testing.assert_array_equal(tile.scores(scaled[a:b]), head.scores(scaled)[a:b])
        np.testing.assert_array_equal(tile.dropped(scaled[a:b]), head.dropped(scaled)[a:b])
        if variant.alibi:
            np.testing.assert_array_equal(tile.alibi_terms(b - a, m), head.alibi_terms(n, m)[a:b])
            np.testing.assert_array_equal(tile.flash_shift(b - a, m), head.flash_shift(n, m)[a:b])
        inner = tile.rows_of(2, 5, b - a)  # a tile of a tile: rows a + 2 .. a + 5 of the head
        np.testing.assert_array_equal(inner.hidden(3, m), head.hidden(n, m)[a + 2:a + 5])


def test_small_heads_are_one_tile():
    # The exact partial-sum model of a sum over the queries does not split into tiles.
    assert tiles.row_tiles(512, 512, 64) == [(0, 512)]            # 512·512·64 MACs: exact
    assert tiles.row_tiles(600, 600, 8) == [(0, 600)]             # fits in one tile
    cut = tiles.row_tiles(8192, 8192, 64)
    assert len(cut) > 1 and 8 * 8192 * (cut[0][1] - cut[0][0]) <= tiles.TILE_BYTES


def _peak_mb(compute) -> float:
    tracemalloc.start()
    try:
        compute()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def test_no_n_by_m_matrix_is_held(monkeypatch):
    """N = 2048, M = 1024, d = 16 (above the exact model's limit: tiled as a long head is): the
    whole head's bounds hold many N×M float64 matrices (16 MiB each), the tiled ones never one."""
    n, m = 2048, 1024
    variant = Variant(causal=True)
    x = _inputs(variant, n, m, d=16)
    chain = reference_chain(x, SCALE, True, FLASH, variant=variant)
    full = {**x, **chain}

    def bounds():
        cache = tolerance.HeadCache()
        for st in FLASH:
            tolerance.chained_bound(st, full, scale=SCALE, causal=True, cache=cache)
        src = {name: full[name] for name in sources_of(FLASH_GRAD_KEYS, variant)}
        tolerance.stage_bound(FLASH_GRAD_KEYS, src, chain[FLASH_GRAD_KEYS], scale=SCALE, causal=True, cache=cache)
        compute_stage(FLASH_GRAD_VALUES, src, SCALE, True)
    one_matrix = 8 * n * m / 2**20
    monkeypatch.setattr(tiles, "TILE_BYTES", 1 << 40)
    whole = _peak_mb(bounds)
    monkeypatch.setattr(tiles, "TILE_BYTES", 1 << 17)
    tiled = _peak_mb(bounds)
    print(f"peak: whole head {whole:.0f} MiB, tiled {tiled:.1f} MiB, one N×M matrix {one_matrix:.0f} MiB")
    assert tiled < one_matrix < whole / 4


def _run(binary, case, out, *args) -> None:
    """The CPU binary on the case."""
    done = subprocess.run([str(binary), "--in", str(case), "--out", str(out), "--backend", "cpu", *map(str, args)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _flash_run(tmp_path, *gen):
    case, out = tmp_path / "in", tmp_path / "out"
    backward = () if "--page-size" in gen else ("--backward",)  # (paged caches: the forward alone)
    sizes = () if "--seqlens" in gen else ("--seq-q", 45, "--seq-k", 70)  # (packed: the sequences' total)
    r = invoke("generate", "--out", case, "--heads", 4, *sizes, "--d-k", 16, "--d-v", 16,
               "--format", "npy", *backward, *gen)
    assert r.exit_code == 0, r.output
    return case, out


@pytest.mark.parametrize("gen,split", [(("--kv-heads", 2, "--causal", "bottom-right"), 0),
                                       (("--window", "9,4", "--softcap", 2), 0),
                                       (("--mask", "document", "--bias", "random", "--alibi"), 0),
                                       (("--causal", "top-left"), 32),
                                       (("--seqlens", "20,25", "--seqlens-k", "30,40", "--causal", "bottom-right"), 0),
                                       (("--seqlens", "20,25", "--seqlens-k", "32,40", "--page-size", 8), 0)],
                         ids=["gqa-causal-br", "window-softcap", "mask-bias-alibi", "causal-split-kv", "packed",
                              "paged"])
def test_the_check_reports_the_same_tiled(tmp_path, binary, monkeypatch, gen, split):
    """(A run that splits the keys is sized whole, its splits' references and bounds tiled.)"""
    case, out = _flash_run(tmp_path, *gen)
    _run(binary, case, out, "--stages", "flash", *(("--split-size", split) if split else ()))
    run = open_run(out, load_input_case(case))
    assert sizing.tiled_run(run) == (not split)
    monkeypatch.setattr(dot, "ENERGY_EXACT_MAX_MACS", 10)
    reports = []
    for tile_bytes in (1 << 40, 8 * 70 * 8):
        monkeypatch.setattr(tiles, "TILE_BYTES", tile_bytes)
        r = invoke("check", "--in", case, "--out", out, "--jobs", 1, "--json", tmp_path / "r.json")
        assert r.exit_code == 0, r.output
        reports.append(json.loads((tmp_path / "r.json").read_text()))
    assert_same_report(*reports, rtol=RTOL, diagnoses=False)
    dims = reports[0]["dims"]  # each query head's stages, each K/V head's
    heads = {True: dims["kv_heads"] or dims["heads"], False: dims["heads"]}
    sequences = (reports[0]["sequences"] or {"count": 1})["count"]  # (each sequence checked alone)
    assert len(reports[0]["results"]) == sequences * sum(heads[STAGES[s].kv] for s in run.stages)


def test_a_run_with_an_n_by_m_stage_is_sized_whole(tmp_path, binary):
    """A run whose stages (or what they read) hold N×M matrices, or a half pipeline's flash
    stages, is checked and sized as a whole head; the flash stages alone at float32 in tiles."""
    case, out = _flash_run(tmp_path)
    runs = {}
    for name, args in (("all", ()), ("flash", ("--stages", "flash")),
                       ("bf16", ("--stages", "flash", "--precision", "bf16"))):
        _run(binary, case, tmp_path / name, *args)
        runs[name] = open_run(tmp_path / name, load_input_case(case))
    assert not sizing.tiled_run(runs["all"]) and not sizing.tiled_run(runs["bf16"])
    assert sizing.tiled_run(runs["flash"])
    long = {k: dataclasses.replace(r, dims=Dims(1, 1, 8192, 8192, 64, 64)) for k, r in runs.items()}
    assert sizing.head_bytes(long["flash"]) < 1 << 30 < 10 * sizing.head_bytes(long["flash"]) < sizing.head_bytes(long["all"])
    # (a failing long head's slab: a dense check of DIAGNOSIS_SCORES scores; a head held whole has none)
    assert sizing.slab_bytes(long["flash"]) > 8 * sizing.DIAGNOSIS_SCORES and sizing.slab_bytes(long["all"]) == 0


@pytest.mark.parametrize("gen", [("--causal", "top-left"), ("--kv-heads", 2)], ids=["mha", "grouped"])
def test_a_gradients_tolerance_override_skips_its_isolated_bound(tmp_path, binary, monkeypatch, gen):
    """With --tol on the flash gradients their isolated bounds are never asked for, so their
    references come without the pass that would compute those bounds too (a grouped run's dK and dV
    summed over each group's query heads as well); without it, they do."""
    case, out = _flash_run(tmp_path, *gen)
    _run(binary, case, out, "--stages", "flash")
    shared, own = [], tolerance.flash_own_and_references
    monkeypatch.setattr(tolerance, "flash_own_and_references", lambda *a: shared.append(1) or own(*a))
    tols = [a for g in (FLASH_GRAD_QUERIES, FLASH_GRAD_KEYS, FLASH_GRAD_VALUES) for a in ("--tol", f"{g}=1")]
    r = invoke("check", "--in", case, "--out", out, "--jobs", 1, *tols)
    assert r.exit_code == 0 and not shared, r.output
    r = invoke("check", "--in", case, "--out", out, "--jobs", 1)
    assert r.exit_code == 0 and shared, r.output


def _count(monkeypatch, module, name: str) -> list:
    """A list that grows by one at each call of module.name."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("gen", [("--causal", "top-left"), ("--kv-heads", 2), ("--window", "9,4", "--softcap", 2),
                                 ("--mask", "document", "--bias", "random", "--alibi"), ("--dropout", 0.2)],
                         ids=["causal", "grouped", "window-softcap", "mask-bias-alibi", "dropout"])
def test_the_chains_flash_references_come_from_its_bounds_pass(tmp_path, binary, monkeypatch, gen):
    """Where the flash stages' chained bounds are asked, the pass over the row tiles of the flash
    backward's chained bound gives their chained references too: neither the forward's reference
    pass nor the gradients' runs, and the report is the one those passes give. With --tol on every
    flash stage no chained bound is asked: the references take their own passes, and the backward
    chain runs only for the check that dK's columns sum to 0."""
    case, out = _flash_run(tmp_path, *gen)
    _run(binary, case, out, "--stages", "flash")
    monkeypatch.setattr(dot, "ENERGY_EXACT_MAX_MACS", 10)
    monkeypatch.setattr(tiles, "TILE_BYTES", 8 * 70 * 8)
    forward, grads = _count(monkeypatch, flash_spec, "stack_over_rows"), _count(monkeypatch, flash_tiles, "_gradients")
    chains = _count(monkeypatch, flash_chain_pass, "_chain_pass")

    def report(*args):
        r = invoke("check", "--in", case, "--out", out, "--jobs", 1, "--json", tmp_path / "r.json", *args)
        assert r.exit_code == 0, r.output
        return json.loads((tmp_path / "r.json").read_text())
    shared = report()
    assert chains and not forward and not grads
    with monkeypatch.context() as m:  # the references from passes of their own
        m.setattr(tolerance, "chained_flash_references", lambda *a, **k: {})
        own = report()
    assert forward and grads
    assert_same_report(shared, own, rtol=RTOL, diagnoses=False)
    del chains[:], forward[:], grads[:]
    asked = _count(monkeypatch, tolerance, "chained_flash_references")
    assert report(*[a for st in FLASH for a in ("--tol", f"{st}=1")])["passed"]
    assert not asked and forward and grads
    if "--softcap" in gen:  # (elsewhere dK's column-sum check reads the backward chain)
        assert not chains


@pytest.mark.parametrize("gen,precision,tol", [(("--causal", "top-left"), "fp32", ()), (("--kv-heads", 2), "fp32", ()),
                                               (("--kv-heads", 2), "fp32", ("--tol", "flash_dQ=1e-2")),
                                               (("--window", "9,4", "--softcap", 2), "fp32", ()),
                                               (("--mask", "document", "--bias", "random", "--alibi"), "fp32", ()),
                                               (("--dropout", 0.2), "fp32", ()), (("--causal", "top-left"), "bf16", ())],
                         ids=["causal", "grouped", "grouped-dQ-tol", "window-softcap", "mask-bias-alibi", "dropout",
                              "bf16"])
def test_the_chains_pass_computes_the_gradients_isolated_bounds(tmp_path, binary, monkeypatch, gen, precision, tol):
    """Where the program wrote flash_output and flash_lse, the flash gradients' isolated bounds and
    references (from those files) come from the chain's pass over the row tiles, which shares each
    tile's Q·Kᵀ, logits, dP and their variances with them: the isolated pass of its own does not
    run, and the report is the one that pass gives (a grouped head's summed dK and dV read them too,
    whatever the tolerance of dQ)."""
    case, out = _flash_run(tmp_path, *gen)
    _run(binary, case, out, "--stages", "flash", "--precision", precision)
    monkeypatch.setattr(dot, "ENERGY_EXACT_MAX_MACS", 10)
    monkeypatch.setattr(tiles, "TILE_BYTES", 8 * 70 * 8)
    isolated = _count(monkeypatch, flash_bounds, "over_queries")  # (the isolated pass's tiles)

    def report():
        r = invoke("check", "--in", case, "--out", out, "--jobs", 1, "--json", tmp_path / "r.json", *tol)
        assert r.exit_code == 0, r.output
        return json.loads((tmp_path / "r.json").read_text())
    joint = report()
    assert not isolated
    with monkeypatch.context() as m:  # the program's outputs read in turn: the isolated pass of its own
        m.setattr(compare, "early_outputs", lambda *a, **k: {})
        apart = report()
    assert len(isolated) == 4  # (a head each)
    assert_same_report(joint, apart, rtol=RTOL, diagnoses=False)


def test_a_forward_run_runs_no_backward_chain(tmp_path, binary, monkeypatch):
    case, out = tmp_path / "in", tmp_path / "out"
    r = invoke("generate", "--out", case, "--heads", 2, "--seq-q", 45, "--seq-k", 70, "--d-k", 16, "--d-v", 16,
               "--format", "npy", "--causal", "top-left")
    assert r.exit_code == 0, r.output
    _run(binary, case, out, "--stages", "flash")
    monkeypatch.setattr(tiles, "TILE_BYTES", 8 * 70 * 8)
    chains = _count(monkeypatch, flash_chain_pass, "_chain_pass")
    forward = _count(monkeypatch, flash_spec, "stack_over_rows")
    r = invoke("check", "--in", case, "--out", out, "--jobs", 1)
    assert r.exit_code == 0 and not chains and forward, r.output


def _foreign_flash_backward(case, out, heads: int, scale: float, bug: str = "") -> None:
    """A NumPy program's flash forward and backward in float32, its own arithmetic order (keys in
    tiles of 16: an online softmax forward; a backward that recomputes the weights from its lse),
    %.9g text under its own names, no run.toml. bug "dk-unscaled": dK without the softmax scale."""
    out.mkdir()
    f32 = np.float32
    for h in range(heads):
        q, k, v, do = (np.loadtxt(case / f"{x}_head_{h}.txt", ndmin=2).astype(f32) for x in ("Q", "K", "V", "dO"))
        n, m = q.shape[0], k.shape[0]
        acc, mx, l = np.zeros((n, v.shape[1]), f32), np.full((n, 1), -np.inf, f32), np.zeros((n, 1), f32)
        for j in range(0, m, 16):
            s = (q @ k[j:j + 16].T) * f32(scale)
            new = np.maximum(mx, s.max(axis=1, keepdims=True))
            p, r = np.exp(s - new), np.exp(mx - new)
            acc, l, mx = acc * r + p @ v[j:j + 16], l * r + p.sum(axis=1, keepdims=True), new
        o, lse = acc / l, mx + np.log(l)
        d = (do * o).sum(axis=1, keepdims=True)
        dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
        for j in range(0, m, 16):
            p = np.exp((q @ k[j:j + 16].T) * f32(scale) - lse)
            ds = p * (do @ v[j:j + 16].T - d)
            dq += f32(scale) * (ds @ k[j:j + 16])
            dk[j:j + 16] = (ds.T @ q) * (f32(1) if bug == "dk-unscaled" else f32(scale))
            dv[j:j + 16] = p.T @ do
        for name, x in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
            np.savetxt(out / f"{name}{h}.txt", x, fmt="%g" if name == "lse" else "%.9g")


@pytest.mark.parametrize("how", ["whole", "row-tiles", "row-tiles-torch"])
@pytest.mark.parametrize("bug", ["", "dk-unscaled"], ids=["correct", "dk-unscaled"])
def test_a_foreign_flash_backward_checks_against_the_chains_references(tmp_path, monkeypatch, bug, how):
    """Another program's flash forward and backward (its own names, %.9g and %g text, no run.toml,
    its own order of arithmetic): the chained references from the backward chain's pass pass it
    where it is right and fail it, at the stage, where it is not; whole, in row tiles of 8 rows
    (the isolated pass's row terms, D's dot products' variance of the whole head, sliced to each
    tile), and in row tiles through PyTorch's float64 (the GPU's code, on the CPU)."""
    if how != "whole":
        monkeypatch.setattr(dot, "ENERGY_EXACT_MAX_MACS", 0)  # (the exact model keeps a head whole)
        monkeypatch.setattr(tiles, "TILE_BYTES", 8 * 72 * 8)
        monkeypatch.setattr(tiles, "DEVICE_TILE_BYTES", 8 * 72 * 8)
    if how == "row-tiles-torch":
        pytest.importorskip("array_api_compat", reason="array-api-compat is not installed (pip install 'attnstep[gpu]')")
        pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'attnstep[gpu]')")
        monkeypatch.setattr(check_cli, "_device", lambda name: "torch-cpu")
    counts, real_tiles = [], tiles.row_tiles
    monkeypatch.setattr(tiles, "row_tiles", lambda *a: counts.append(len(real_tiles(*a))) or real_tiles(*a))
    case = tmp_path / "in"
    r = invoke("generate", "--out", case, "--heads", 2, "--seq-q", 40, "--seq-k", 72, "--d-k", 16, "--d-v", 16,
               "--no-causal", "--backward")
    assert r.exit_code == 0, r.output
    _foreign_flash_backward(case, tmp_path / "out", 2, 0.25, bug)
    chains = _count(monkeypatch, flash_chain_pass, "_chain_pass")
    forward = _count(monkeypatch, flash_spec, "stack_over_rows")
    isolated = _count(monkeypatch, flash_bounds, "over_queries")  # (the gradients' isolated pass of its own)
    names = [a for st, f in zip(FLASH, ("o", "lse", "dq", "dk", "dv")) for a in ("--name", f"{st}={f}{{i}}.txt")]
    r = invoke("check", "--in", case, "--out", tmp_path / "out", "--jobs", 1, "--json", tmp_path / "r.json", *names)
    report = json.loads((tmp_path / "r.json").read_text())
    assert chains and (max(counts) == 5) == (how != "whole"), counts  # (40 query rows: 5 tiles of 8)
    if not bug:
        assert not forward  # (the references from the chain's pass; a failing stage's diagnoses take their own)
        # (its text files' isolated bounds from the chain's pass too, on NumPy; a device's passes are apart)
        assert len(isolated) == (2 if how == "row-tiles-torch" else 0), isolated
        assert r.exit_code == 0 and report["passed"], r.output
    else:
        assert r.exit_code == 1 and report["first_failing_stage"] == FLASH_GRAD_KEYS, r.output


def test_the_flash_floor_takes_the_inputs_magnitudes_only_for_products_near_the_flush_range(monkeypatch):
    """The flushed-products floor: 2·FLUSH for ordinary data, without a pass over |Q|, |K|, |dO|
    (a head's worth of N·d arrays); where dO·Vᵀ's products come near float32's normal range, the
    lost products' bound scaled by the largest finite input magnitude, as before."""
    rng = np.random.default_rng(3)
    src = {n: rng.normal(size=(s, 8)) for n, s in (("Q", 5), ("K", 7), ("V", 7), ("dO", 5))}
    src["Q"][0, 0] = np.inf  # (not finite: left out of the magnitude)
    real = flash_bounds.finite_abs
    monkeypatch.setattr(flash_bounds, "finite_abs", lambda x: pytest.fail("magnitudes taken for ordinary data"))
    assert flash_bounds.flash_floor(src) == 2 * FLUSH
    monkeypatch.setattr(flash_bounds, "finite_abs", real)
    src["V"] = src["V"] * 1e-36
    tiny = tiles.flush_max(src["dO"], src["V"].T)
    assert tiny > 0
    largest = max(1.0, *(float(np.max(np.where(np.isfinite(src[n]), np.abs(src[n]), 0.0))) for n in ("Q", "K", "dO")))
    assert flash_bounds.flash_floor(src) == 2 * FLUSH + tiny * largest * (5 + 7)
