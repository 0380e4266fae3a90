"""The CPU backend on every attention variant, through the binary, against a float64 NumPy reference
built with verify/variant.py (tests/helpers/variant_reference.py): bottom-right causal with N < M
and N > M (rows that see no key), sliding windows with both alignments, softcap, ALiBi (standard
slopes and a slopes file), mask files per head and broadcast (a fully masked row), a bias with
-inf entries, dropout, and a few of them together.

Every stage of the stage path and of the flash kernels, forward and backward, is compared at a
float32-level bound (the verifier's tolerance model is not under test here); masked entries
exactly (-inf scores, 0 weights, 0 dS); the flash path equal to the stage path; dropout's mask
equal to the keep hash recomputed in NumPy, and its keep rate near 1 − p. Sizes are irregular
(N = 37, M = 53, d = 24 for the stage path alone, d = 32 with the flash kernels); a few larger
cases span several 64-wide tiles, so that skipped key tiles on both sides of a window show.
"""
from __future__ import annotations

import subprocess
import tomllib

import numpy as np
import pytest

from verify.stages import (BACKWARD_STAGES, DROPOUT_MASK, FLASH_HEAD_DIMS, FORWARD_STAGES, RUN_MANIFEST, STAGES, Dims,
                           stage_file)
from verify.variant import BOTTOM_RIGHT, BROADCAST, PER_HEAD, TOP_LEFT, Variant, dropout_keep_tolerance

from helpers.variant_reference import dropout_keep, kv_reference, reference, write_variant_case

GRADS = ("dQ", "dK", "dV")
BOUND = 1e-4   # max |binary − reference| ≤ BOUND · the stage's largest |value|: float32 with room
# The smallest "largest value" BOUND applies to: a stage that is 0 but for rounding (a window of one
# key makes dS = P∘(dP − D) = 0 in exact arithmetic, float32 leaves ~1e-7 of dP) is held to
# BOUND · FLOOR absolute.
FLOOR = 1e-2
N, M = 37, 53


def dims(n=N, m=M, d=32, heads=3, batch=1, kv_heads=0) -> Dims:
    return Dims(batch=batch, heads=heads, seq_q=n, seq_k=m, d_k=d, d_v=d, kv_heads=kv_heads)


def _masks(n: int, m: int, heads: int, seed: int) -> np.ndarray:
    """Random 0/1 masks (about 1 in 4 dropped) with row 5 of every head fully masked."""
    keep = (np.random.default_rng(seed).random((heads, n, m)) > 0.25).astype(np.float32)
    keep[:, 5, :] = 0
    return keep


def _biases(n: int, m: int, heads: int, seed: int) -> np.ndarray:
    """Random biases with about 1 in 10 entries -inf and row 3 of every head wholly -inf."""
    rng = np.random.default_rng(seed)
    bias = rng.standard_normal((heads, n, m)).astype(np.float32)
    bias[rng.random((heads, n, m)) < 0.1] = -np.inf
    bias[:, 3, :] = -np.inf
    return bias


# (id, variant, (N, M, batch), write_variant_case options, and "kv_heads" for grouped K/V heads);
# batch 2 where the flat head matters (dropout's counter, a slopes file's rows).
NM, MN = (N, M, 1), (M, N, 1)
SLOPES = [[0.5, 0.03125, 0.25], [0.25, 0.015625, 0.125]]
CASES = [
    ("causal-bottom-right-N<M", Variant(causal=True, align=BOTTOM_RIGHT), NM, {}),
    ("causal-bottom-right-N>M", Variant(causal=True, align=BOTTOM_RIGHT), MN, {}),
    *[(f"window{l},{r}-{a}", Variant(window=(l, r), align=a), NM, {})
      for (l, r) in ((3, 2), (0, 0), (5, -1)) for a in (TOP_LEFT, BOTTOM_RIGHT)],
    ("window0,0-bottom-right-N>M", Variant(window=(0, 0), align=BOTTOM_RIGHT), MN, {}),
    ("softcap30", Variant(softcap=30.0), NM, {"q_spread": 4.0}),
    ("softcap5-causal", Variant(softcap=5.0, causal=True), NM, {"q_spread": 4.0}),
    ("alibi-standard", Variant(alibi=True), NM, {}),
    ("alibi-bottom-right-causal", Variant(alibi=True, causal=True, align=BOTTOM_RIGHT), NM, {}),
    ("alibi-slopes-file", Variant(alibi=True), (N, M, 2), {"slopes": SLOPES}),
    ("alibi-slopes-file-every-batch", Variant(alibi=True), (N, M, 2), {"slopes": SLOPES[:1]}),
    ("mask-per-head", Variant(mask=PER_HEAD), NM, {"masks": _masks(N, M, 3, 1)}),
    ("mask-broadcast-causal", Variant(mask=BROADCAST, causal=True), NM, {"masks": _masks(N, M, 1, 2)[0]}),
    ("bias-per-head-inf", Variant(bias=PER_HEAD), NM, {"biases": _biases(N, M, 3, 3)}),
    ("bias-broadcast-inf", Variant(bias=BROADCAST), NM, {"biases": _biases(N, M, 1, 4)[0]}),
    ("dropout0.1", Variant(dropout=0.1, dropout_seed=7), (N, M, 2), {}),
    ("dropout0.5-causal", Variant(dropout=0.5, dropout_seed=123456789, causal=True), (N, M, 2), {}),
    ("mqa-causal-bottom-right-dropout", Variant(causal=True, align=BOTTOM_RIGHT, dropout=0.2, dropout_seed=5),
     (N, M, 2), {"kv_heads": 1}),
    ("all-together", Variant(causal=True, align=BOTTOM_RIGHT, window=(9, -1), softcap=5.0, alibi=True,
                             bias=PER_HEAD, mask=BROADCAST, dropout=0.25, dropout_seed=3), NM,
     {"q_spread": 4.0, "masks": _masks(N, M, 1, 5)[0], "biases": _biases(N, M, 3, 6)}),
]

# Several 64-wide tiles each way: key tiles left of a window and right of the diagonal are skipped.
TILED_CASES = [
    ("window3,2-bottom-right-tiled", Variant(window=(3, 2), align=BOTTOM_RIGHT), (150, 200, 1), {}),
    ("window70,10-top-left-tiled", Variant(window=(70, 10)), (200, 150, 1), {}),
    ("causal-bottom-right-N>M-tiled", Variant(causal=True, align=BOTTOM_RIGHT), (200, 130, 1), {}),
    ("window5,-1-dropout-tiled", Variant(window=(5, -1), dropout=0.5, dropout_seed=1), (150, 200, 1), {}),
]


def run_cpu(binary, in_dir, out_dir, *extra) -> dict:
    proc = subprocess.run([str(binary), "--in", str(in_dir), "--out", str(out_dir), "--backend", "cpu",
                           *map(str, extra)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return tomllib.loads((out_dir / RUN_MANIFEST).read_text())


def load(out_dir, stage: str, head: int) -> np.ndarray:
    return np.load(out_dir / stage_file(stage, head, "npy")).astype(np.float64)


def assert_close(what: str, got: np.ndarray, ref: np.ndarray):
    """Within BOUND of the stage's largest value, and -inf exactly where the reference is."""
    assert got.shape == ref.shape, what
    assert np.array_equal(np.isneginf(got), np.isneginf(ref)), f"{what}: -inf in other places"
    finite = np.isfinite(ref)
    assert np.isfinite(got[finite]).all(), f"{what}: a non-finite value where the reference is finite"
    if not finite.any():
        return
    size = max(np.abs(ref[finite]).max(), FLOOR)
    err = np.abs(got[finite] - ref[finite]).max()
    assert err <= BOUND * size, f"{what}: max |diff| {err:.3g} > {BOUND} x {size:.3g}"


def assert_masked_exactly(what: str, out_dir, head: int, ref: dict):
    """Masked scores are -inf, their weights and dS exactly +0; a row that sees no key has output 0,
    lse -inf, D 0 and dQ 0."""
    hid = ref["hidden"]
    got = {s: load(out_dir, s, head) for s in ("QK_scaled", "attention_weights", "dS")}
    assert np.isneginf(got["QK_scaled"][hid]).all() and np.isfinite(got["QK_scaled"][~hid]).all(), what
    for s in ("attention_weights", "dS"):
        assert (got[s][hid] == 0).all() and not np.signbit(got[s][hid]).any(), f"{what} {s}: not +0 where masked"
    empty = hid.all(axis=1)
    for s in ("output", "flash_output", "D", "dQ", "flash_dQ"):
        path = out_dir / stage_file(s, head, "npy")
        if path.exists():
            assert (load(out_dir, s, head)[empty] == 0).all(), f"{what} {s}: not 0 in a row that sees no key"
    if (out_dir / stage_file("flash_lse", head, "npy")).exists():
        assert np.isneginf(load(out_dir, "flash_lse", head)[empty]).all(), f"{what}: lse not -inf in an empty row"


def expected_stages(variant: Variant, flash: bool) -> set:
    """Every stage of a case with dO: the flash ones where the head size allows them, the keep-mask
    only under dropout."""
    every = {s for s in FORWARD_STAGES + BACKWARD_STAGES if flash or not STAGES[s].flash}
    return {s for s in every if not STAGES[s].dropout} | ({DROPOUT_MASK} if variant.dropout else set())


def check_case(binary, tmp_path, name, variant, size, options, d, *extra):
    """Runs the case, compares every stage file (per query head, or per K/V head) with the
    reference, the masked entries exactly and the flash path with the stage path."""
    n, m, batch = size
    options = dict(options)
    dm = dims(n, m, d=d, batch=batch, kv_heads=options.pop("kv_heads", 0))
    case = write_variant_case(tmp_path / "in", dm, variant, **options)
    run = run_cpu(binary, tmp_path / "in", tmp_path / "out", *extra)
    written = set(run["stages"].split(","))
    flash = d in FLASH_HEAD_DIMS
    assert written == expected_stages(variant, flash), name
    out = tmp_path / "out"
    refs = {h: reference(case, h) for h in range(dm.total_heads)}
    for stage in sorted(written):
        for i in range(dm.heads_of(stage)):
            ref = kv_reference(refs, dm, stage, i) if STAGES[stage].kv else refs[i][stage]
            assert_close(f"{name} {stage} head {i}", load(out, stage, i), ref)
            if flash and stage in GRADS + ("output",):  # the flash kernels agree with the stage path
                assert_close(f"{name} flash_{stage} vs {stage} head {i}", load(out, f"flash_{stage}", i),
                             load(out, stage, i))
    for h in range(dm.total_heads):
        assert_masked_exactly(f"{name} head {h}", out, h, refs[h])


@pytest.mark.parametrize("d", [24, 32], ids=["d24", "d32"])
@pytest.mark.parametrize("name,variant,size,options", [pytest.param(*c, id=c[0]) for c in CASES])
def test_every_stage_matches_the_reference(binary, tmp_path, name, variant, size, options, d):
    check_case(binary, tmp_path, name, variant, size, options, d)


@pytest.mark.parametrize("name,variant,size,options", [pytest.param(*c, id=c[0]) for c in TILED_CASES])
def test_tiled_cases_skip_only_invisible_tiles(binary, tmp_path, name, variant, size, options):
    check_case(binary, tmp_path, name, variant, size, options, 32)


@pytest.mark.parametrize("p,seed", [(0.1, 7), (0.5, 123456789), (0.9, 0)])
def test_dropout_mask_is_the_keep_hash(binary, tmp_path, p, seed):
    """The keep-mask holds exactly the hash's decisions for each flat query head (batch-major), only
    0 and 1, and keeps 1 − p of the entries within the binomial bound the verifier uses."""
    dm = dims(n=61, m=97, batch=2)
    write_variant_case(tmp_path / "in", dm, Variant(dropout=p, dropout_seed=seed))
    run_cpu(binary, tmp_path / "in", tmp_path / "out", "--stages", DROPOUT_MASK)
    kept = total = 0
    for head in range(dm.total_heads):
        z = load(tmp_path / "out", DROPOUT_MASK, head)
        assert set(np.unique(z)) <= {0.0, 1.0}
        assert np.array_equal(z == 1, dropout_keep(seed, head, dm.seq_q, dm.seq_k, p)), f"head {head}"
        kept, total = kept + int(z.sum()), total + z.size
    assert dropout_keep_tolerance(kept, total, p) is None


def test_heads_computed_one_at_a_time_give_the_same_bytes(binary, tmp_path):
    """A memory budget that fits one head makes every head group a single head: the backend finds
    each head's mask, bias, slope and dropout counter through the group's first head."""
    variant = Variant(causal=True, align=BOTTOM_RIGHT, softcap=5.0, alibi=True, bias=PER_HEAD, mask=PER_HEAD,
                      dropout=0.3, dropout_seed=11)
    dm = dims(n=150, m=130, d=16, batch=2)
    write_variant_case(tmp_path / "in", dm, variant, q_spread=4.0, masks=_masks(150, 130, 6, 7),
                       biases=_biases(150, 130, 6, 8), slopes=SLOPES)
    run_cpu(binary, tmp_path / "in", tmp_path / "together")
    run_cpu(binary, tmp_path / "in", tmp_path / "alone", "--max-memory-mb", 1)
    files = sorted(p.name for p in (tmp_path / "together").glob("*.npy"))
    assert files and files == sorted(p.name for p in (tmp_path / "alone").glob("*.npy"))
    for f in files:
        assert (tmp_path / "together" / f).read_bytes() == (tmp_path / "alone" / f).read_bytes(), f


def test_dropout_seed_and_head_change_the_mask(binary, tmp_path):
    dm = dims(batch=1, heads=2)
    masks = []
    for seed in (1, 2):
        write_variant_case(tmp_path / f"in{seed}", dm, Variant(dropout=0.5, dropout_seed=seed))
        run_cpu(binary, tmp_path / f"in{seed}", tmp_path / f"out{seed}", "--stages", DROPOUT_MASK)
        masks += [load(tmp_path / f"out{seed}", DROPOUT_MASK, h) for h in range(2)]
    assert not np.array_equal(masks[0], masks[1]), "two heads drew the same mask"
    assert not np.array_equal(masks[0], masks[2]), "two seeds drew the same mask"


def test_stages_under_dropout_pull_in_the_keep_mask(binary, tmp_path):
    """output and dV name the keep-mask as a source: asked for alone, they are computed from it,
    drop the entries the hash drops, and come with it (without it they could not be checked)."""
    case = write_variant_case(tmp_path / "in", dims(), Variant(dropout=0.5, dropout_seed=4))
    run = run_cpu(binary, tmp_path / "in", tmp_path / "out", "--stages", "output,dV")
    assert set(run["stages"].split(",")) == {"output", "dV", DROPOUT_MASK}
    assert sorted(p.name for p in (tmp_path / "out").glob("*.npy")) == sorted(
        stage_file(s, h, "npy") for s in ("output", "dV", DROPOUT_MASK) for h in range(3))
    for h in range(3):
        ref = reference(case, h)
        for s in ("output", "dV"):
            assert_close(f"{s} head {h}", load(tmp_path / "out", s, h), ref[s])


def test_no_dropout_writes_no_mask(binary, tmp_path):
    write_variant_case(tmp_path / "in", dims(), Variant(causal=True, align=BOTTOM_RIGHT))
    run = run_cpu(binary, tmp_path / "in", tmp_path / "out")
    assert DROPOUT_MASK not in run["stages"].split(",")
    assert not list((tmp_path / "out").glob(f"{DROPOUT_MASK}_*"))


def test_flash_backward_with_variants_is_deterministic(binary, tmp_path):
    variant = Variant(window=(20, 3), align=BOTTOM_RIGHT, softcap=5.0, alibi=True, dropout=0.3, dropout_seed=9)
    write_variant_case(tmp_path / "in", dims(n=150, m=200), variant, q_spread=4.0)
    for out in ("a", "b"):
        run_cpu(binary, tmp_path / "in", tmp_path / out, "--stages", "flash")
    for stage in ("flash_dQ", "flash_dK", "flash_dV"):
        for head in range(3):
            a, b = ((tmp_path / out / stage_file(stage, head, "npy")).read_bytes() for out in ("a", "b"))
            assert a == b, f"{stage} head {head} differs between two runs"
