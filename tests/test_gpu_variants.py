"""The CUDA backend's attention variants against the CPU backend, file by file, and under the
verifier (gpu marker; one test, of the kernels' key ranges, compiles their header for the host): grouped K/V heads, both causal alignments, sliding windows, softcap, ALiBi,
mask and bias files, dropout; the stage path and every flash kernel (clean, fast, wgmma) in the
instantiation that takes the case's variant.

Each case runs on the CPU backend and on the CUDA backend (--poison, so an element a kernel skips
stays NaN), and every stage file of the CUDA run is compared with the CPU run's: within the
precision's tolerance of the stage's largest magnitude, -inf exactly where the CPU has it, the
keep-mask exactly, and 0 exactly in the weights and dS where the CPU's scores are masked. The
verifier then checks the CUDA run on its own (`attnstep check` reads the variant from run.toml).
Shapes are irregular (tails in N and M, N > M with rows that see no key, several key tiles);
mask, bias and slopes files come from the case generator (verify/files/patterns.py).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest

from verify.files.case import read_matrix
from verify.files.generate import generate_case
from verify.files.outputs import load_run
from verify.model.half import storage_unit
from verify.runs.runner import run_binary
from verify.stages import DROPOUT_MASK, FLASH_LSE, FLASH_OUTPUT, HALF_PRECISIONS, Dims, parse_stage_file
from verify.variant import BOTTOM_RIGHT, Variant

from helpers.environment import REPO
from helpers.flash_gradients import FLASH_GRADS

gpu = pytest.mark.gpu

# Largest difference allowed, relative to the largest finite magnitude of the CPU's stage: FP32
# lands near 1e-6 (the GEMMs' and exponentials' orders differ), TF32 operands near 1e-3; a half
# format's values differ by a few units where a rounding falls the other way.
FP32_TOL = 1e-4
TF32_TOL = 1e-2
HALF_UNITS = 8
# The verifier's exact bounds cost seconds a head at the larger shapes: it checks the runs of at
# most this many score entries.
VERIFIED_MAX_SCORES = 200_000
# The stages whose masked entries are exactly 0 (their CPU scores -inf).
ZERO_WHERE_MASKED = ("attention_weights", "dS")
KERNELS = ("clean", "fast", "wgmma")


@dataclass(frozen=True)
class Case:
    """A case to generate: its dimensions, variant, and the generator's mask/bias/slopes inputs
    (verify/files/patterns.py VariantInputs keywords)."""
    id: str
    dims: Dims
    variant: Variant
    inputs: Dict[str, object] = field(default_factory=dict)

    @property
    def per_element_inputs(self) -> bool:
        """Mask or bias files or dropout: the clean flash kernel's alone."""
        return bool(self.inputs.get("mask") or self.inputs.get("bias")) or self.variant.dropout > 0

    @property
    def scores(self) -> int:
        return self.dims.total_heads * self.dims.seq_q * self.dims.seq_k


CASES = [
    Case("gqa-causal-bottom-right", Dims(1, 6, 70, 133, 64, 64, kv_heads=2), Variant(causal=True, align=BOTTOM_RIGHT)),
    # N > M: the first 33 rows see no key (output 0, lse -inf).
    Case("causal-bottom-right-empty-rows", Dims(2, 2, 130, 97, 32, 32), Variant(causal=True, align=BOTTOM_RIGHT)),
    Case("window-both-sides", Dims(1, 2, 200, 260, 128, 128), Variant(window=(40, 9), align=BOTTOM_RIGHT)),
    Case("causal-window-top-left", Dims(1, 3, 150, 150, 64, 64), Variant(causal=True, window=(31, 0))),
    Case("window-right-only", Dims(1, 2, 90, 75, 16, 16), Variant(window=(-1, 5))),
    Case("mqa-softcap-causal", Dims(1, 4, 128, 200, 64, 64, kv_heads=1), Variant(causal=True, softcap=5.0)),
    Case("softcap-alibi-window", Dims(1, 4, 100, 180, 128, 128),
         Variant(window=(60, 20), softcap=3.0, alibi=True, align=BOTTOM_RIGHT), {"slopes": "random"}),
    Case("alibi-causal-bottom-right", Dims(2, 3, 64, 96, 32, 32), Variant(causal=True, align=BOTTOM_RIGHT, alibi=True)),
    Case("mask-per-head-empty-rows", Dims(1, 3, 77, 140, 64, 64), Variant(),
         {"mask": "random", "mask_heads": "per-head", "empty_rows": True}),
    Case("document-mask-causal", Dims(1, 2, 96, 96, 64, 64), Variant(causal=True),
         {"mask": "document", "mask_heads": "broadcast"}),
    Case("bias-per-head-softcap", Dims(1, 2, 70, 90, 32, 32), Variant(softcap=4.0),
         {"bias": "random", "bias_heads": "per-head"}),
    Case("gqa-dropout-causal-bottom-right", Dims(1, 4, 120, 100, 64, 64, kv_heads=2),
         Variant(causal=True, align=BOTTOM_RIGHT, dropout=0.2, dropout_seed=7)),
    Case("everything", Dims(1, 4, 83, 150, 64, 64, kv_heads=2),
         Variant(window=(50, 3), softcap=6.0, alibi=True, dropout=0.1, dropout_seed=3),
         {"mask": "prefix-lm", "mask_heads": "per-head", "bias": "random", "bias_heads": "broadcast"}),
    # d 24: no flash kernel, the stage path alone.
    Case("stage-path-odd-width", Dims(1, 6, 37, 53, 24, 24, kv_heads=2),
         Variant(causal=True, align=BOTTOM_RIGHT, softcap=2.5, alibi=True, dropout=0.15, dropout_seed=1),
         {"mask": "random", "mask_heads": "per-head"}),
]
BY_ID = {c.id: c for c in CASES}
# The cases the flash kernels are forced on one by one (every feature of the tensor-core kernels,
# and the clean kernel's refusals elsewhere).
FLASH_CASES = [BY_ID[i] for i in ("gqa-causal-bottom-right", "causal-bottom-right-empty-rows", "window-both-sides",
                                  "causal-window-top-left", "window-right-only", "mqa-softcap-causal",
                                  "softcap-alibi-window", "alibi-causal-bottom-right", "everything")]
# The half-precision flash forward (wgmma, d 64 and 128, no per-element inputs).
HALF_CASES = [BY_ID[i] for i in ("gqa-causal-bottom-right", "window-both-sides", "causal-window-top-left",
                                 "mqa-softcap-causal", "softcap-alibi-window")]


def make_case(folder: Path, case: Case) -> Path:
    from verify.files.patterns import VariantInputs  # the generator's variant inputs
    return generate_case(folder, case.dims, seed=13, distribution="normal", fmt="npy", backward=True,
                         variant=case.variant, inputs=VariantInputs(**case.inputs))


def run(binary: Path, in_dir: Path, out_dir: Path, backend: str, *extra: str, expect_ok: bool = True):
    res = run_binary(binary, in_dir, out_dir, backend=backend, check=False,
                     extra=[*(["--poison"] if backend == "cuda" else []), *extra])
    if expect_ok:
        assert res.returncode == 0, res.stderr
    return res


def skip_without_kernel(res, kernel: str) -> None:
    """Skips where this GPU or width has no such kernel (wgmma: compute capability 9.0, d 64/128)."""
    if res.returncode == 2 and f"no {kernel} variant for d=" in res.stderr:
        pytest.skip(f"this GPU has no {kernel} kernel for the case: {res.stderr.strip()}")


def stage_files(folder: Path) -> List[str]:
    return sorted(n for n in os.listdir(folder) if parse_stage_file(n))


def difference(got: np.ndarray, want: np.ndarray) -> float:
    """max |got − want| over the finite entries of `want`, relative to its largest magnitude; inf
    where the infinities differ (masked entries: exactly), NaN where `got` holds a NaN."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf")
    if np.isnan(got).any():
        return float("nan")
    inf = np.isinf(want)
    if not np.array_equal(np.isinf(got), inf) or not np.array_equal(got[inf], want[inf]):
        return float("inf")
    if inf.all():
        return 0.0
    return float(np.abs(got[~inf] - want[~inf]).max() / max(np.abs(want[~inf]).max(), 1e-30))


def compare_runs(cpu: Path, cuda: Path, tol: float) -> List[str]:
    """Every stage file of both runs (the same set): what differs beyond `tol`, or in a masked or
    kept entry."""
    names = stage_files(cuda)
    assert names == stage_files(cpu), (names, stage_files(cpu))
    failures = []
    for name in names:
        stage, head, _ = parse_stage_file(name)
        got, want = read_matrix(cuda / name), read_matrix(cpu / name)
        if stage == DROPOUT_MASK:
            if not np.array_equal(got, want):
                failures.append(f"{name}: {int((got != want).sum())} keep decisions differ")
            continue
        err = difference(got, want)
        if not err <= tol:  # NaN fails too
            failures.append(f"{name}: {err:.3g} (tol {tol:g})")
        scores = cpu / name.replace(stage, "QK_scaled", 1)
        if stage in ZERO_WHERE_MASKED and scores.exists():
            masked = np.isneginf(read_matrix(scores))
            if np.any(got[masked] != 0):
                failures.append(f"{name}: {int((got[masked] != 0).sum())} masked entries not exactly 0")
    return failures


def verified(in_dir: Path, out_dir: Path, case: Case) -> None:
    from verify.check.compare import check  # the verifier, imported where it is used
    if case.scores > VERIFIED_MAX_SCORES:
        return
    report = check(in_dir, out_dir)  # the run's variant, precision and kernel from its run.toml
    assert report.passed, [(r.stage, r.head, r.status, r.message) for r in report.results if not r.passed]


# ---- the stage path and the flash kernel `auto` takes ----------------------------------------------

@gpu
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_stage_matches_the_cpu_backend(binary, tmp_path, case):
    in_dir = make_case(tmp_path / "in", case)
    run(binary, in_dir, tmp_path / "cuda", "cuda")
    run(binary, in_dir, tmp_path / "cpu", "cpu")
    failures = compare_runs(tmp_path / "cpu", tmp_path / "cuda", FP32_TOL)
    assert not failures, failures
    values = load_run(tmp_path / "cuda").values
    if case.dims.flash_supported and case.per_element_inputs:
        assert values["flash_kernel"] == "cuda-clean", values["flash_kernel"]
    verified(in_dir, tmp_path / "cuda", case)


@gpu
def test_several_groups_match_one_group(binary, tmp_path):
    """--max-memory-mb 2 cuts the heads into groups of one (1.1 MiB each on the host): each group's
    mask and bias files, slopes and dropout's flat head index must follow it."""
    case = BY_ID["everything"]
    in_dir = make_case(tmp_path / "in", case)
    run(binary, in_dir, tmp_path / "whole", "cuda")
    run(binary, in_dir, tmp_path / "parts", "cuda", "--max-memory-mb", "2")
    failures = compare_runs(tmp_path / "whole", tmp_path / "parts", 1e-6)
    assert not failures, failures


# ---- each flash kernel forced ---------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", FLASH_CASES, ids=[c.id for c in FLASH_CASES])
def test_each_flash_kernel_matches_the_cpu_backend(binary, tmp_path, case, kernel, precision):
    if kernel == "clean" and precision == "tf32":
        pytest.skip("the clean kernel is plain FP32 at tf32 too: its fp32 run covers it")
    in_dir = make_case(tmp_path / "in", case)
    flags = ["--stages", "flash", "--precision", precision]
    res = run(binary, in_dir, tmp_path / "cuda", "cuda", *flags, "--flash-kernel", kernel, expect_ok=False)
    skip_without_kernel(res, kernel)
    if case.per_element_inputs and kernel != "clean":
        assert res.returncode == 2 and f"no {kernel} variant for mask or bias files or dropout" in res.stderr, \
            res.stderr
        return
    assert res.returncode == 0, res.stderr
    assert load_run(tmp_path / "cuda").values["flash_kernel"].startswith(f"cuda-{kernel}")
    run(binary, in_dir, tmp_path / "cpu", "cpu", *flags)
    failures = compare_runs(tmp_path / "cpu", tmp_path / "cuda", FP32_TOL if precision == "fp32" else TF32_TOL)
    assert not failures, failures
    verified(in_dir, tmp_path / "cuda", case)


# Rows that see no key among rows that do, in a head of few query blocks (the tensor-core kernels
# split the KV loop and merge the parts), and a narrow window over many key tiles (skipped on both
# sides of it).
EDGE_CASES = [Case("empty-rows-split", Dims(1, 1, 700, 600, 64, 64), Variant(causal=True, align=BOTTOM_RIGHT)),
              Case("narrow-window-long-keys", Dims(1, 1, 256, 4096, 64, 64), Variant(window=(40, 8))),
              Case("narrow-window-softcap-alibi", Dims(1, 2, 130, 2000, 128, 128),
                   Variant(window=(100, 0), softcap=8.0, alibi=True, align=BOTTOM_RIGHT))]


@gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", EDGE_CASES, ids=[c.id for c in EDGE_CASES])
def test_flash_kernels_at_the_edges_of_the_mask(binary, tmp_path, case, kernel):
    in_dir = make_case(tmp_path / "in", case)
    res = run(binary, in_dir, tmp_path / "cuda", "cuda", "--stages", "flash", "--flash-kernel", kernel,
              expect_ok=False)
    skip_without_kernel(res, kernel)
    assert res.returncode == 0, res.stderr
    run(binary, in_dir, tmp_path / "cpu", "cpu", "--stages", "flash")
    failures = compare_runs(tmp_path / "cpu", tmp_path / "cuda", FP32_TOL)
    assert not failures, failures
    n, m = case.dims.seq_q, case.dims.seq_k
    empty = [r for r in range(n) if case.variant.key_range(n, m, r)[0] >= case.variant.key_range(n, m, r)[1]]
    cuda = load_run(tmp_path / "cuda")
    for head in range(case.dims.total_heads):
        lse = read_matrix(cuda.file(FLASH_LSE, head)).reshape(-1)
        out = read_matrix(cuda.file(FLASH_OUTPUT, head))
        assert np.all(np.isneginf(lse[empty])) and np.all(out[empty] == 0), f"{kernel} head {head}: empty rows"
        assert np.all(np.isfinite(np.delete(lse, empty))), f"{kernel} head {head}: a row that sees keys"


# ---- the half-precision flash forward -------------------------------------------------------------

@gpu
@pytest.mark.parametrize("precision", HALF_PRECISIONS)
@pytest.mark.parametrize("case", HALF_CASES, ids=[c.id for c in HALF_CASES])
def test_the_half_flash_forward_matches_the_cpu_backend(binary, tmp_path, case, precision):
    """The wgmma bf16/fp16 kernel's variant instantiation (its softcap's tanh on the special-function
    unit) against the CPU backend's emulation of it: the output within a few units of the format,
    lse within 1e-3 (and -inf exactly where the CPU's is)."""
    in_dir = make_case(tmp_path / "in", case)
    flags = ["--stages", f"{FLASH_OUTPUT},{FLASH_LSE}", "--precision", precision]
    res = run(binary, in_dir, tmp_path / "cuda", "cuda", *flags, "--flash-kernel", "wgmma", expect_ok=False)
    skip_without_kernel(res, "wgmma")
    assert res.returncode == 0, res.stderr
    run(binary, in_dir, tmp_path / "cpu", "cpu", *flags)
    cuda, cpu = load_run(tmp_path / "cuda"), load_run(tmp_path / "cpu")
    assert cuda.values["flash_kernel"].startswith(f"cuda-wgmma-{precision}"), cuda.values["flash_kernel"]
    for head in range(case.dims.total_heads):
        err = difference(read_matrix(cuda.file(FLASH_OUTPUT, head)), read_matrix(cpu.file(FLASH_OUTPUT, head)))
        assert err < HALF_UNITS * storage_unit(precision), f"{precision} head {head}: flash_output off by {err:.3g}"
        got, want = (read_matrix(r.file(FLASH_LSE, head)).reshape(-1) for r in (cuda, cpu))
        assert np.array_equal(np.isneginf(got), np.isneginf(want)), f"head {head}: rows that see no key"
        finite = np.isfinite(want)
        assert np.abs(got[finite] - want[finite]).max(initial=0) < 1e-3, f"{precision} head {head}: flash_lse"
    verified(in_dir, tmp_path / "cuda", case)


# The half-precision flash backward (wgmma, d 64 and 128): the variants of the forward's cases, the
# edges of the mask (rows that see no key, a narrow window over many key tiles), and query blocks
# whose rows see no key at all (the dQ kernel's block with an empty range of key tiles).
HALF_BACKWARD_CASES = HALF_CASES + EDGE_CASES + [
    Case("window-past-the-keys", Dims(1, 1, 400, 100, 64, 64), Variant(window=(20, 0)))]
GRAD_UNITS = 16  # gradients: sums of products of rounded P and dS, a few more units than the output


@gpu
@pytest.mark.parametrize("precision", HALF_PRECISIONS)
@pytest.mark.parametrize("case", HALF_BACKWARD_CASES, ids=[c.id for c in HALF_BACKWARD_CASES])
def test_the_half_flash_backward_matches_the_cpu_backend(binary, tmp_path, case, precision):
    """The wgmma bf16/fp16 backward's variant instantiation (the rule's tiles alone, the softcap's
    tanh on the special-function unit and its derivative, ALiBi) against the CPU backend's emulation
    of it: each gradient within a few units of the format (normwise); the verifier passes the run."""
    in_dir = make_case(tmp_path / "in", case)
    flags = ["--stages", "flash", "--precision", precision]
    res = run(binary, in_dir, tmp_path / "cuda", "cuda", *flags, expect_ok=False)
    if res.returncode == 2 and "no half-precision kernel" in res.stderr:
        pytest.skip(f"this GPU has no half-precision flash backward: {res.stderr.strip()}")
    assert res.returncode == 0, res.stderr
    run(binary, in_dir, tmp_path / "cpu", "cpu", *flags)
    # run.toml names the forward's kernel; the gradients' files are the backward's, which at a half
    # precision only the wgmma kernels write on the CUDA backend (elsewhere they are left out).
    flash_kernel = load_run(tmp_path / "cuda").values["flash_kernel"]
    assert flash_kernel.startswith(f"cuda-wgmma-{precision}"), flash_kernel
    grads = [[n for n in stage_files(tmp_path / side) if parse_stage_file(n)[0] in FLASH_GRADS]
             for side in ("cuda", "cpu")]
    assert grads[0] and grads[0] == grads[1], grads
    for name in grads[0]:
        err = difference(read_matrix(tmp_path / "cuda" / name), read_matrix(tmp_path / "cpu" / name))
        assert err < GRAD_UNITS * storage_unit(precision), f"{precision} {name}: off by {err:.3g}"
    verified(in_dir, tmp_path / "cuda", case)

# ---- the kernels' key ranges, on the host ----------------------------------------------------------

_RULE_PROGRAM = r"""
#include <cstdio>
#include "cuda/device_variant.cuh"
using namespace attnstep;
// Every function of DeviceVariant that the kernels skip or mask tiles by, against visible() entry by
// entry, and visible() against variant.h's MaskRule, over small shapes of both alignments and
// windows of every kind; prints the failures and a count.
int main() {
    unsigned x = 12345;
    auto draw = [&](int n) { x = x * 1103515245u + 12345u; return static_cast<int>((x >> 8) % n); };
    long bad = 0;
    for (int it = 0; it < 400; ++it) {
        const int N = 1 + draw(24), M = 1 + draw(24);
        DeviceVariant v;
        v.offset = draw(2) ? M - N : 0;
        v.left = draw(3) ? draw(8) : kUnbounded;
        v.right = draw(3) ? draw(8) : kUnbounded;
        const MaskRule rule = v.rule();
        auto fail = [&](const char* what, int a, int b, int c, int d) {
            if (++bad <= 20)
                std::printf("%s N=%d M=%d offset=%d left=%d right=%d at %d %d %d %d\n", what, N, M, v.offset, v.left,
                            v.right, a, b, c, d);
        };
        for (int r = -2; r < N + 4; ++r)
            for (int c = -2; c < M + 4; ++c) {
                const bool vis = v.visible(r, c);
                if (vis != rule.visible(r, c)) fail("visible vs MaskRule", r, c, 0, 0);
                if (r >= 0 && c >= 0 && c < M && vis != (c >= v.first_key(r) && c < v.end_key(r, M)))
                    fail("key range", r, c, 0, 0);
            }
        for (int c0 = 0; c0 < M; ++c0)
            for (int c1 = c0 + 1; c1 <= M; ++c1)
                for (int r = 0; r < N; ++r) {
                    bool sees = false;
                    for (int c = c0; c < c1; ++c) sees = sees || v.visible(r, c);
                    if (sees && (r < v.first_row(c0) || r >= v.end_row(c1, N))) fail("row range", r, c0, c1, 0);
                }
        for (int r0 = 0; r0 < N + 3; ++r0)
            for (int r1 = r0 + 1; r1 <= N + 3; r1 += 2)
                for (int c0 = 0; c0 < M + 3; ++c0)
                    for (int c1 = c0 + 1; c1 <= M + 3; c1 += 3) {
                        bool all = true, none = true;
                        for (int r = r0; r < r1; ++r)
                            for (int c = c0; c < c1; ++c) {
                                all = all && v.visible(r, c);
                                none = none && !v.visible(r, c);
                            }
                        if (all != v.all_visible(r0, r1, c0, c1)) fail("all_visible", r0, r1, c0, c1);
                        if (none != v.none_visible(r0, r1, c0, c1)) fail("none_visible", r0, r1, c0, c1);
                    }
    }
    std::printf("failures %ld\n", bad);
}
"""


def test_the_kernels_key_ranges_agree_with_the_rule(tmp_path):
    """device_variant.cuh compiled for the host: the key tiles and query rows every flash kernel
    visits (first_key/end_key, first_row/end_row) hold every visible entry, and the tests by which
    they skip a tile (none_visible) or mask it (all_visible) are exact, for both alignments and
    every kind of window, also for rows past N (the last block's tail)."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        pytest.skip("no C++ compiler")
    src, exe = tmp_path / "rule.cpp", tmp_path / "rule"
    src.write_text(_RULE_PROGRAM)
    subprocess.run([cxx, "-std=c++17", "-O1", "-I", str(REPO / "cuda_src"), str(src), "-o", str(exe)], check=True,
                   timeout=120)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.strip().endswith("failures 0"), out
