"""A float32 NumPy split-KV (flash-decoding) program, written from docs/contract.md's "Split-KV
stages" (not from verify/): split s of a query row covers the keys [s·K, (s+1)·K) of its sequence
that the row sees; each split's log-sum-exp and output normalised by its own sum are computed in
float32 (P rounded to the format before P·V at bf16/fp16, the split stages kept float32), then
combined in float32 into flash_output (rounded to the format at bf16/fp16) and flash_lse. It writes
the stage files as another program would: `%.9g` text, one file per head and split, no run.toml
(or one holding only `split_size`). A bug changes what it computes (BUGS names each).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from verify.files.generate import generate_case
from verify.model.half import round_to_format
from verify.sequences import Sequences
from verify.stages import Dims
from verify.variant import Variant

f32 = np.float32

BUGS = {
    "not_rescaled": "the combine sums the splits' outputs without their weights exp(lse_s - lse)",
    "last_not_rescaled": "the combine adds the last split a row sees keys of without its weight",
    "unnormalized": "the combine weights exp(lse_s - max) are not divided by their sum",
    "exp2": "the combine takes exp2 of the natural-log lse (2^(lse_s - max), lse = max + log2 of their sum)",
    "last_left_out": "the combine's loop stops one split short: the last split a row sees keys of left out",
    "first_only": "the combine takes only the first split a row sees keys of",
    "loop_one_short": "the combine's loop stops one split short of the run's last split (range(splits - 1))",
    "unwritten_output": "flash_output left all zeros (the combine never wrote it)",
    "empty_lse_zero": "a split a row sees no key of writes lse 0 (not -inf), and the combine counts it",
    "empty_nan": "a split a row sees no key of writes NaN (0/0) into its output and lse",
    "empty_counted": "the splits are right, but the combine counts an empty split as lse 0",
    "overlap": "each split but the last covers one key of the next: [s*K, (s+1)*K + 1)",
    "gap": "each split but the first starts one key late: [s*K + 1, (s+1)*K)",
    "tile_not_rescaled": "each split an online softmax over tiles of 4 keys that never rescales its running sum "
                         "and output when a tile raises the row maximum",
}


@dataclass
class SplitCase:
    """A case: dense (seq_q x seq_k) or packed (seqlens_q, seqlens_k), and the split size."""
    split_size: int
    seq_q: int = 8
    seq_k: int = 37
    seqlens_q: Optional[Sequence[int]] = None
    seqlens_k: Optional[Sequence[int]] = None
    heads: int = 4
    kv_heads: int = 2
    d: int = 16
    seed: int = 0
    causal: Union[bool, str] = False   # False, "top-left" or "bottom-right"
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    distribution: str = "normal"
    inputs: Dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def packed(self) -> bool:
        return self.seqlens_q is not None

    def sequences(self) -> List[Tuple[int, int, int, int]]:
        """(first query row, queries, first key row, keys) of every sequence (one in a dense case)."""
        if not self.packed:
            return [(0, self.seq_q, 0, self.seq_k)]
        cq, ck = np.cumsum([0] + list(self.seqlens_q)), np.cumsum([0] + list(self.seqlens_k))
        return [(int(cq[b]), int(self.seqlens_q[b]), int(ck[b]), int(self.seqlens_k[b]))
                for b in range(len(self.seqlens_q))]

    @property
    def splits(self) -> int:
        most = max(m for _, _, _, m in self.sequences())
        return max(1, -(-most // self.split_size))

    def variant(self) -> Variant:
        align = self.causal if isinstance(self.causal, str) else "top-left"
        return Variant(causal=bool(self.causal), align=align, window=self.window, softcap=self.softcap,
                       alibi=self.alibi)


def write_case(case: SplitCase, folder: Path) -> None:
    """The input case (attnstep's generator: its manifest says the variant) and its inputs, read back."""
    if case.packed:
        seqs = Sequences(tuple(np.cumsum([0] + list(case.seqlens_q)).tolist()),
                         tuple(np.cumsum([0] + list(case.seqlens_k)).tolist()))
        dims = Dims(1, case.heads, seqs.total_q, seqs.total_k, case.d, case.d, case.kv_heads)
    else:
        seqs, dims = None, Dims(1, case.heads, case.seq_q, case.seq_k, case.d, case.d, case.kv_heads)
    generate_case(folder, dims, seed=case.seed, distribution=case.distribution, fmt="npy", variant=case.variant(),
                  sequences=seqs)
    for name, count in (("Q", case.heads), ("K", case.kv_heads), ("V", case.kv_heads)):
        for i in range(count):
            case.inputs[f"{name}{i}"] = np.load(folder / f"{name}_head_{i}.npy").astype(f32)


def _slope(case: SplitCase, head: int) -> float:
    """flash-attn's standard ALiBi slopes (a power-of-two head count): 2^(-8(h+1)/H)."""
    return 2.0 ** (-8.0 * (head + 1) / case.heads)


def _scores(case: SplitCase, q, k, head: int, n: int, m: int) -> np.ndarray:
    """The float32 scores of one sequence (n x m): scaled, capped, ALiBi, -inf where hidden."""
    scale = f32(1.0 / np.sqrt(case.d))
    s = (q @ k.T).astype(f32) * scale
    i = np.arange(n)[:, None]
    j = np.arange(m)[None, :]
    diag = i + (m - n if case.causal == "bottom-right" else 0)
    if case.softcap:
        s = (f32(case.softcap) * np.tanh(s / f32(case.softcap))).astype(f32)
    if case.alibi:
        s = (s - f32(_slope(case, head)) * np.abs(diag - j).astype(f32)).astype(f32)
    hidden = np.zeros((n, m), bool)
    if case.causal:
        hidden |= j > diag
    left, right = case.window
    if left >= 0:
        hidden |= j < diag - left
    if right >= 0:
        hidden |= j > diag + right
    return np.where(hidden, -np.inf, s).astype(f32)


def _half(x, precision: str):
    return x if precision in ("fp32", "tf32") else round_to_format(np.asarray(x, f32), precision).astype(f32)


def _split_ranges(case: SplitCase, m: int, bug: Optional[str]) -> List[Tuple[int, int]]:
    out = []
    K = case.split_size
    for s in range(case.splits):
        first, end = s * K, (s + 1) * K
        if bug == "overlap" and end < m:
            end += 1
        if bug == "gap" and s > 0:
            first += 1
        out.append((min(first, m), min(end, m)))
    return out


def _one_split(s: np.ndarray, v: np.ndarray, first: int, end: int, precision: str, bug: Optional[str]):
    """(output n x d, lse n) of the float32 split over the keys [first, end)."""
    n = s.shape[0]
    t = s[:, first:end]
    out = np.zeros((n, v.shape[1]), f32)
    lse = np.full(n, -np.inf, f32)
    sees = np.isfinite(t).any(axis=1) if t.size else np.zeros(n, bool)
    if t.size:
        m = np.where(sees, t.max(axis=1), f32(0)).astype(f32)
        p = np.exp(t - m[:, None], dtype=f32)
        p = np.where(np.isfinite(t), p, f32(0)).astype(f32)
        l = p.sum(axis=1, dtype=f32)
        acc = (_half(p, precision) @ v[first:end]).astype(f32)
        if bug == "tile_not_rescaled":
            l, acc = _unrescaled_tiles(t, v[first:end], 4)
        with np.errstate(invalid="ignore", divide="ignore"):
            out = np.where(sees[:, None], acc if bug == "split_unnormalized" else acc / l[:, None], f32(0)).astype(f32)
            lse = np.where(sees, m + np.log(l), -np.inf).astype(f32)
    if bug == "empty_lse_zero":
        lse = np.where(sees, lse, f32(0)).astype(f32)
    if bug == "empty_nan":
        out = np.where(sees[:, None], out, np.nan).astype(f32)
        lse = np.where(sees, lse, np.nan).astype(f32)
    return out, lse


def _unrescaled_tiles(t: np.ndarray, v: np.ndarray, tile: int):
    """(l, acc) of an online softmax over tiles of `tile` keys that keeps a running maximum m but
    never multiplies l or acc by exp(m_old − m_new); the caller's lse = m + log l takes the final m."""
    n = t.shape[0]
    m, l, acc = np.full(n, -np.inf, f32), np.zeros(n, f32), np.zeros((n, v.shape[1]), f32)
    for k0 in range(0, t.shape[1], tile):
        part = t[:, k0:k0 + tile]
        m = np.maximum(m, part.max(axis=1)).astype(f32)
        with np.errstate(invalid="ignore"):
            p = np.where(np.isfinite(part), np.exp(part - np.where(np.isfinite(m), m, f32(0))[:, None], dtype=f32),
                         f32(0)).astype(f32)
        l = (l + p.sum(axis=1, dtype=f32)).astype(f32)
        acc = (acc + p @ v[k0:k0 + tile]).astype(f32)
    return l, acc


def _combine(outs: np.ndarray, lses: np.ndarray, bug: Optional[str]):
    """float32 combine of (n, S, d) outputs and (n, S) lse."""
    lses = lses.astype(f32)
    if bug == "last_left_out":
        last = (np.isfinite(lses) * np.arange(lses.shape[1])[None, :]).argmax(axis=1)
        lses = lses.copy()
        lses[np.arange(lses.shape[0]), last] = -np.inf
    if bug == "loop_one_short":
        lses = lses.copy()
        lses[:, -1] = -np.inf
    if bug == "first_only":
        first = np.isfinite(lses).argmax(axis=1)
        lses = np.where(np.arange(lses.shape[1])[None, :] == first[:, None], lses, -np.inf).astype(f32)
    if bug == "empty_counted":
        lses = np.where(np.isneginf(lses), f32(0), lses).astype(f32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = np.max(lses, axis=1)
        empty = np.isneginf(m)
        m0 = np.where(empty, f32(0), m).astype(f32)
        e = np.exp(lses - m0[:, None], dtype=f32)
        l = e.sum(axis=1, dtype=f32)
        lse = np.where(empty, -np.inf, m0 + np.log(l)).astype(f32)
        w = np.exp(lses - np.where(empty, f32(0), lse)[:, None], dtype=f32)
        if bug == "lse_is_max":  # (the output right, the lse the largest split's alone)
            lse = np.where(empty, -np.inf, m0).astype(f32)
        if bug == "exp2":
            e = np.exp2(lses - m0[:, None], dtype=f32)
            l = e.sum(axis=1, dtype=f32)
            lse = np.where(empty, -np.inf, m0 + np.log2(l)).astype(f32)
            w = (e / np.where(empty, f32(1), l)[:, None]).astype(f32)
        if bug == "not_rescaled":
            w = np.where(np.isneginf(lses), f32(0), f32(1)).astype(f32)
        if bug == "unnormalized":
            w = e
        if bug == "last_not_rescaled":
            rows = np.arange(w.shape[0])
            last = (np.isfinite(lses) * np.arange(lses.shape[1])[None, :]).argmax(axis=1)
            w = w.copy()
            w[rows, last] = np.where(np.isfinite(lses[rows, last]), f32(1), w[rows, last])
        terms = np.where((w > 0)[:, :, None] | np.isnan(w)[:, :, None], w[:, :, None] * outs, f32(0))
        out = np.where(empty[:, None], f32(0), terms.sum(axis=1, dtype=f32)).astype(f32)
    if bug == "unwritten_output":
        out = np.zeros_like(out)
    return out, lse


def program(case: SplitCase, bug: Optional[str] = None, precision: str = "fp32") -> Dict[str, List[np.ndarray]]:
    """Every head's split stages (lists of S matrices) and flash stages over the case's rows."""
    group = case.heads // case.kv_heads
    total_q = sum(n for _, n, _, _ in case.sequences())
    S = case.splits
    res: Dict[str, list] = {"split_output": [], "split_lse": [], "flash_output": [], "flash_lse": []}
    for h in range(case.heads):
        q = _half(case.inputs[f"Q{h}"], precision)
        k = _half(case.inputs[f"K{h // group}"], precision)
        v = _half(case.inputs[f"V{h // group}"], precision)
        outs = np.zeros((total_q, S, case.d), f32)
        lses = np.full((total_q, S), -np.inf, f32)
        for q0, n, k0, m in case.sequences():
            if n == 0:
                continue
            s = _scores(case, q[q0:q0 + n], k[k0:k0 + m], h, n, m)
            for sp, (first, end) in enumerate(_split_ranges(case, m, bug)):
                outs[q0:q0 + n, sp], lses[q0:q0 + n, sp] = _one_split(s, v[k0:k0 + m], first, end, precision, bug)
        out, lse = _combine(outs, lses, bug)
        res["split_output"].append([outs[:, sp] for sp in range(S)])
        res["split_lse"].append([lses[:, sp:sp + 1] for sp in range(S)])
        res["flash_output"].append(_half(out, precision))
        res["flash_lse"].append(lse[:, None])
    return res


def write_text(path: Path, mat: np.ndarray, fmt: str = "%.9g") -> None:
    path.write_text("\n".join(" ".join(fmt % x for x in row) for row in np.atleast_2d(mat)) + "\n")


def run_program(case: SplitCase, out: Path, bug: Optional[str] = None, precision: str = "fp32",
                stages: Sequence[str] = ("split_output", "split_lse", "flash_output", "flash_lse"),
                run_toml: bool = False, fmt: str = "%.9g") -> Dict[str, list]:
    """Runs the program and writes its files into `out` (with run_toml: a run.toml holding only
    split_size)."""
    out.mkdir(parents=True, exist_ok=True)
    res = program(case, bug, precision)
    for h in range(case.heads):
        for stage in stages:
            if stage.startswith("split_"):
                for sp, mat in enumerate(res[stage][h]):
                    write_text(out / f"{stage}_head_{h}_split_{sp}.txt", mat, fmt)
            else:
                write_text(out / f"{stage}_head_{h}.txt", res[stage][h], fmt)
    if run_toml:
        (out / "run.toml").write_text(f"split_size = {case.split_size}\n")
    return res


# ---- the false-alarm sweep's split runs ------------------------------------------------------------

SPLIT_SWEEP_SEED = 20261126
PRECISIONS = ("fp32", "fp32", "fp32", "bf16", "fp16")
MAX_SWEPT_SPLITS = 24


def draw_split_case(index: int) -> Tuple[SplitCase, str]:
    """Case `index` of the split sweep and its precision: dense (1 to 40 queries, 1 to 300 keys) or
    packed (up to 4 sequences, some without queries or keys), grouped K/V heads, either causal
    alignment or none, windows, softcaps, ALiBi, every input distribution, and split sizes from 1 key
    (where that makes at most MAX_SWEPT_SPLITS splits) to more than every key (one split), so that
    rows see no key of some splits."""
    rng = np.random.default_rng([SPLIT_SWEEP_SEED, index])
    heads = int(rng.choice([1, 2, 4, 8]))
    kv_heads = int(rng.choice([k for k in (1, 2, 4, 8) if heads % k == 0]))
    shape: Dict[str, object] = {}
    if rng.random() < 0.35:
        count = int(rng.integers(1, 5))
        shape["seqlens_q"] = [int(x) for x in rng.integers(0, 7, count)]
        shape["seqlens_k"] = [int(x) for x in rng.integers(0, 120, count)]
        shape["seqlens_q"][0] = max(1, shape["seqlens_q"][0])
        most = max(shape["seqlens_k"])
    else:
        shape["seq_q"], shape["seq_k"] = int(rng.integers(1, 41)), int(rng.integers(1, 301))
        most = shape["seq_k"]
    causal = [False, "top-left", "bottom-right"][int(rng.integers(3))]
    window = (-1, -1)
    if rng.random() < 0.25:
        window = (int(rng.integers(0, 40)), 0 if causal else int(rng.integers(-1, 20)))
    # (at most MAX_SWEPT_SPLITS splits: each is checked over every key, so a case costs S times a flash check)
    fewest = max(1, -(-most // MAX_SWEPT_SPLITS))
    split_size = int(rng.choice([fewest, max(fewest, int(rng.integers(2, 17))), max(fewest, most // 3),
                                 most + int(rng.integers(1, 9))]))
    case = SplitCase(split_size=max(1, split_size), heads=heads, kv_heads=kv_heads, d=int(rng.choice([16, 32, 64, 128])),
                     seed=index, causal=causal, window=window,
                     softcap=float(rng.uniform(1, 50)) if rng.random() < 0.25 else 0.0, alibi=bool(rng.random() < 0.25),
                     distribution=str(rng.choice(["uniform", "normal", "large"])), **shape)
    return case, str(rng.choice(PRECISIONS))
