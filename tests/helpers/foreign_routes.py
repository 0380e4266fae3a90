"""Independent float32 attention implementations, and the ways users' programs write their files.

The verifier must accept any correct float32 implementation, not only the project's binary. Each
stage here has several valid routes (a different summation order, exp2 instead of exp, a
reciprocal instead of a division, an online softmax over key tiles, a FlashAttention-2 style
tiled forward ...), written with NumPy in float32 and independent of verify/check/reference.py. A
`Route` picks one route per stage; `compute_heads` runs it over every head, optionally with one
classic bug planted the way a buggy program would have it (everything downstream computed from
the bugged value). The writers put the result into an output folder in the file contract's
naming (docs/contract.md), printed the way users' programs print, without run.toml.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from verify.stages import FLASH_HEAD_DIMS, FORWARD_STAGES, INPUT_NAMES, STAGE_NAMES, STAGES, Dims, stage_file

f32 = np.float32
f64 = np.float64
LOG2E = f32(1.0 / math.log(2.0))  # exp(x) = exp2(x·log2(e))
LN2 = f32(math.log(2.0))
SPLIT_K_CHUNK = 16

# ---- matrix products: A (R×k) · B (k×C), float32 results, each a different summation order ----


def mm_blas(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a.astype(f32) @ b.astype(f32)


def mm_f64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Accumulated in float64, rounded once to float32."""
    return (a.astype(f64) @ b.astype(f64)).astype(f32)


def mm_split_k(a: np.ndarray, b: np.ndarray, chunk: int = SPLIT_K_CHUNK) -> np.ndarray:
    """Blocked over k: one float32 GEMM per chunk, partial results summed in float32."""
    acc = np.zeros((a.shape[0], b.shape[1]), f32)
    for k0 in range(0, a.shape[1], chunk):
        acc = acc + mm_blas(a[:, k0:k0 + chunk], b[k0:k0 + chunk])
    return acc


def mm_reverse(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One float32 rank-1 update per k, from the last k to the first."""
    a, b = a.astype(f32), b.astype(f32)
    acc = np.zeros((a.shape[0], b.shape[1]), f32)
    for k in range(a.shape[1] - 1, -1, -1):
        acc = acc + a[:, k, None] * b[None, k, :]
    return acc


def mm_pairwise(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The k products summed as a balanced binary tree in float32."""
    t = a.astype(f32)[:, :, None] * b.astype(f32)[None, :, :]  # R × k × C
    while t.shape[1] > 1:
        if t.shape[1] % 2:  # adding an exact zero keeps the tree's roundings
            t = np.concatenate([t, np.zeros_like(t[:, :1])], axis=1)
        half = t.shape[1] // 2
        t = t[:, :half] + t[:, half:]
    return t[:, 0]


MATMULS: Dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "blas": mm_blas, "f64": mm_f64, "splitk": mm_split_k, "reverse": mm_reverse, "pairwise": mm_pairwise,
}
QK_ROUTES = tuple(MATMULS)
OUTPUT_ROUTES = ("blas", "f64", "reverse")

# ---- masking -----------------------------------------------------------------------------------


def masked_where(n: int, m: int, col0: int = 0, offset: int = 0, window: Optional[int] = None) -> np.ndarray:
    """True where key col0 + c is hidden from query r: top-left aligned, c > r + offset (and, with
    a left window, c < r + offset − window)."""
    j = (col0 + np.arange(m))[None, :] - np.arange(n)[:, None] - offset
    return (j > 0) | (j < -window) if window is not None else j > 0


def apply_mask(s: np.ndarray, causal: bool, col0: int = 0, offset: int = 0, window: Optional[int] = None) -> np.ndarray:
    if not causal:
        return s
    return np.where(masked_where(*s.shape, col0, offset, window), f32(-np.inf), s).astype(f32)


# ---- QK_scaled ---------------------------------------------------------------------------------


def _other_order(qk_route: str) -> str:
    """A summation order other than the one QK was computed with."""
    return "reverse" if qk_route != "reverse" else "pairwise"


def scaled_scores(route: str, q, k, qk, scale: float, qk_route: str) -> np.ndarray:
    """QK_scaled before masking, by one of SCALED_ROUTES."""
    if route == "mul":  # fl(QK·scale) from the QK the program wrote
        return qk * f32(scale)
    if route == "div":  # QK / (1/scale): QK/√d_k for the default scale
        return qk / f32(1.0 / scale)
    if route == "folded":  # (Q·scale)·Kᵀ as its own GEMM: not fl(QK·scale) bit for bit
        return mm_blas(q * f32(scale), k.T)
    if route == "regemm":  # QK_scaled from its own GEMM, in another order than QK's
        return MATMULS[_other_order(qk_route)](q, k.T) * f32(scale)
    raise ValueError(route)


SCALED_ROUTES = ("mul", "div", "folded", "regemm")

# ---- softmax -----------------------------------------------------------------------------------


def _row_max(s: np.ndarray) -> np.ndarray:
    return s.max(axis=1, keepdims=True)


def _softmax_plain(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - _row_max(s))
    return e / e.sum(axis=1, keepdims=True)


def _softmax_exp2(s: np.ndarray) -> np.ndarray:
    e = np.exp2((s - _row_max(s)) * LOG2E)
    return e / e.sum(axis=1, keepdims=True)


def _softmax_reciprocal(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - _row_max(s))
    return e * (f32(1) / e.sum(axis=1, keepdims=True))


def _softmax_exp64(s: np.ndarray) -> np.ndarray:
    e = np.exp((s - _row_max(s)).astype(f64)).astype(f32)
    return e / e.sum(axis=1, keepdims=True)


def _softmax_online(s: np.ndarray, tile: int) -> np.ndarray:
    """Running max and rescaled running sum over key tiles (one pass), then exp(s - m) / l."""
    n = s.shape[0]
    m = np.full((n, 1), -np.inf, f32)
    l = np.zeros((n, 1), f32)
    for c0 in range(0, s.shape[1], tile):
        t = s[:, c0:c0 + tile]
        m_new = np.maximum(m, _row_max(t))
        # key 0 is visible to every row, so m_new is finite from the first tile on
        l = l * np.exp(m - m_new) + np.exp(t - m_new).sum(axis=1, keepdims=True)
        m = m_new
    return np.exp(s - m) / l


def _softmax_lse(s: np.ndarray) -> np.ndarray:
    """Exponentiated against the float32 log-sum-exp, exp(s - lse), as a two-pass softmax (and the
    FlashAttention backward's recomputation) does: no division by the row's own sum."""
    m = _row_max(s)
    lse = m + np.log(np.exp(s - m).sum(axis=1, keepdims=True))
    return np.exp(s - lse)


SOFTMAX_TILES = (16, 32, 64)
SOFTMAXES: Dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "exp": _softmax_plain, "exp2": _softmax_exp2, "recip": _softmax_reciprocal, "exp64": _softmax_exp64,
    "lse": _softmax_lse,
    **{f"online{t}": (lambda s, t=t: _softmax_online(s, t)) for t in SOFTMAX_TILES},
}
SOFTMAX_ROUTES = tuple(SOFTMAXES)


def softmax_columns(s: np.ndarray) -> np.ndarray:
    """The classic bug: normalized along the wrong axis."""
    return _softmax_plain(s.T).T

# ---- FlashAttention-2 style forward ------------------------------------------------------------


def flash_forward(q, k, v, scale: float, causal: bool, block: int, use_exp2: bool,
                  mask_offset: int = 0, window: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Tiled online-softmax forward over key tiles of width `block`, all in float32.
    Returns (output N×d_v, natural-log lse N×1). exp2: log2(e) folded into the score scale."""
    q, k, v = q.astype(f32), k.astype(f32), v.astype(f32)
    n = q.shape[0]
    factor = f32(scale / math.log(2.0)) if use_exp2 else f32(scale)
    expf = np.exp2 if use_exp2 else np.exp
    m = np.full((n, 1), -np.inf, f32)
    l = np.zeros((n, 1), f32)
    o = np.zeros((n, v.shape[1]), f32)
    for c0 in range(0, k.shape[0], block):
        s = apply_mask(mm_blas(q, k[c0:c0 + block].T) * factor, causal, c0, mask_offset, window)
        m_new = np.maximum(m, _row_max(s))
        safe = np.where(np.isneginf(m_new), f32(0), m_new)  # (a row that has seen no key yet: a window)
        p = expf(s - safe)
        alpha = expf(m - safe)
        l = alpha * l + p.sum(axis=1, keepdims=True)
        o = alpha * o + mm_blas(p, v[c0:c0 + block])
        m = m_new
    lse = (m * LN2 if use_exp2 else m) + np.log(l)
    return (o / l).astype(f32), lse.astype(f32)


FLASH_BLOCKS = (16, 32, 64)
FLASH_ROUTES = tuple(f"{e}-{b}" for e in ("exp", "exp2") for b in FLASH_BLOCKS)


def parse_flash_route(name: str) -> Tuple[bool, int]:
    kind, block = name.split("-")
    return kind == "exp2", int(block)

# ---- one route per stage, and the bugs a program can have --------------------------------------


@dataclass(frozen=True)
class Route:
    qk: str = "blas"
    scaled: str = "mul"
    softmax: str = "exp"
    output: str = "blas"
    flash: str = "exp-64"

    def __str__(self) -> str:
        return f"qk={self.qk} scaled={self.scaled} softmax={self.softmax} output={self.output} flash={self.flash}"


ROUTE_CHOICES = {"qk": QK_ROUTES, "scaled": SCALED_ROUTES, "softmax": SOFTMAX_ROUTES,
                 "output": OUTPUT_ROUTES, "flash": FLASH_ROUTES}

# A bug changes one computation the way a faulty program would; everything downstream of it is
# computed from the bugged value. Bugs applied to the written heads (swaps, one wrong element)
# are in `corrupt_heads`.
BUGS = ("layout", "scale", "axis", "mask+1", "mask-1", "lse_log2", "flash_scale", "head_swap",
        "one_element")


def flash_supported(d_k: int, d_v: int) -> bool:
    return d_k == d_v and d_k in FLASH_HEAD_DIMS


def compute_head(q, k, v, scale: float, causal: bool, route: Route = Route(),
                 bug: Optional[str] = None) -> Dict[str, np.ndarray]:
    """Every stage of one head in float32 (the flash stages where the head dims support them)."""
    q, k, v = (np.ascontiguousarray(x, dtype=f32) for x in (q, k, v))
    offset = {"mask+1": 1, "mask-1": -1}.get(bug, 0)
    k_read = k.reshape(k.shape[1], k.shape[0]).T if bug == "layout" else k  # K read column-major
    out = {"Q": q.copy(), "K": k.copy(), "V": v.copy(), "KT": np.ascontiguousarray(k.T)}
    out["QK"] = MATMULS[route.qk](q, k_read.T)
    s = scaled_scores(route.scaled, q, k_read, out["QK"], 1.0 if bug == "scale" else scale, route.qk)
    out["QK_scaled"] = apply_mask(s.astype(f32), causal, offset=offset)
    with np.errstate(invalid="ignore"):  # a shifted mask may hide a whole row: NaN, as a program gets
        softmax = softmax_columns if bug == "axis" else SOFTMAXES[route.softmax]
        out["attention_weights"] = softmax(out["QK_scaled"])
        out["output"] = MATMULS[route.output](out["attention_weights"], v)
        if flash_supported(q.shape[1], v.shape[1]):
            use_exp2, block = parse_flash_route(route.flash)
            o, lse = flash_forward(q, k, v, 1.0 if bug == "flash_scale" else scale, causal, block,
                                   use_exp2, offset)
            out["flash_output"], out["flash_lse"] = o, (lse * LOG2E if bug == "lse_log2" else lse)
    return {name: np.ascontiguousarray(x, dtype=f32) for name, x in out.items()}


def corrupt_heads(heads: List[Dict[str, np.ndarray]], bug: Optional[str]) -> None:
    """Bugs in how results reach the files: one head's output written as another's, or one
    element of output far off (1e-3 of the largest |value|, far above any printed rounding)."""
    if bug == "head_swap":
        heads[0]["output"], heads[1]["output"] = heads[1]["output"], heads[0]["output"]
    elif bug == "one_element":
        o = heads[-1]["output"]
        r, c = o.shape[0] // 2, o.shape[1] // 3
        o[r, c] += f32(1e-3) * np.abs(o).max()


def compute_heads(inputs: Sequence[Dict[str, np.ndarray]], scale: float, causal: bool,
                  route: Route = Route(), bug: Optional[str] = None) -> List[Dict[str, np.ndarray]]:
    heads = [compute_head(*(x[n] for n in INPUT_NAMES), scale, causal, route, bug) for x in inputs]
    corrupt_heads(heads, bug)
    return heads

# ---- writers: how users' programs print ---------------------------------------------------------


TEXT_FORMATS = {"g9": "%.9g", "g6": "%g", "f6": "%.6f"}  # %g: C++ ostream's default, 6 digits
TEXT_WRITERS = (*TEXT_FORMATS, "mixed")
NPY_WRITERS = ("npy", "npy_flat", "npy_4d")
WRITERS = TEXT_WRITERS + NPY_WRITERS
# Which stages a program writes: everything it computed; only output; only the flash stages; the
# original program's eight stage-path stages.
SUBSETS = {
    "all": FORWARD_STAGES,
    "output": ("output",),
    "flash": tuple(s for s in FORWARD_STAGES if STAGES[s].flash),
    "seed": tuple(s for s in FORWARD_STAGES if not STAGES[s].flash),
}


def printed_format(writer: str, stage: str, head: int) -> Optional[str]:
    """The printf format of one text file (None: the writer writes .npy)."""
    if writer == "mixed":  # some files %.9g, some %g
        return TEXT_FORMATS["g9" if (STAGE_NAMES.index(stage) + head) % 2 else "g6"]
    return TEXT_FORMATS.get(writer)


def write_text(path: Path, arr: np.ndarray, fmt: str) -> None:
    np.savetxt(path, np.asarray(arr, dtype=f32).astype(f64), fmt=fmt, delimiter=" ")


def write_outputs(folder: Path, heads: List[Dict[str, np.ndarray]], dims: Dims, writer: str,
                  subset: str = "all", only: Optional[Sequence[str]] = None) -> List[str]:
    """Writes the stages of `subset` (or `only` those) that the heads hold into `folder` (no
    run.toml); returns the stage names written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stages = [s for s in (SUBSETS[subset] if only is None else only) if s in heads[0]]
    for stage in stages:
        if writer in ("npy_flat", "npy_4d"):  # <stage>.npy holding all heads
            stack = np.stack([h[stage] for h in heads]).astype("<f4")
            if writer == "npy_4d":
                stack = stack.reshape(dims.batch, dims.heads, *stack.shape[1:])
            np.save(folder / f"{stage}.npy", stack)
            continue
        for i, h in enumerate(heads):
            fmt = printed_format(writer, stage, i)
            if fmt is None:
                np.save(folder / stage_file(stage, i, "npy"), h[stage].astype("<f4"))
            else:
                write_text(folder / stage_file(stage, i, "txt"), h[stage], fmt)
    return stages


def read_inputs(folder: Path, heads: int) -> List[Dict[str, np.ndarray]]:
    """Q, K, V of every head from an input case folder (.txt or .npy), as float32."""
    out = []
    for i in range(heads):
        mats = {}
        for name in INPUT_NAMES:
            npy = Path(folder) / stage_file(name, i, "npy")
            mats[name] = (np.load(npy) if npy.exists() else
                          np.loadtxt(Path(folder) / stage_file(name, i, "txt"), ndmin=2, dtype=f64)).astype(f32)
        out.append(mats)
    return out

# ---- the backward pass ---------------------------------------------------------------------------

# Bugs of the backward pass, planted like the forward's: everything downstream computed from the
# bugged value. "bwd_mask" recomputes the flash backward's P without the causal mask; "bwd_lse_log2"
# feeds the natural-log lse into an exp2 without converting it; "dq_key_rows" adds each tile's dQ
# term at the key tile's rows; "dV_untransposed_tile" adds P_tile·dO_tile to dV (square tiles).
BACKWARD_BUGS = ("D_wrong_O", "dS_missing_P", "grad_unscaled", "dV_untransposed_P", "bwd_mask", "bwd_lse_log2",
                 "dq_key_rows", "dV_untransposed_tile", "dq_uses_v", "dv_uses_ds", "dk_untransposed_tile",
                 "bwd_lse_max", "dq_first_key_tile", "dkdv_first_query_tile", "bwd_scores_1_over_d")


@dataclass(frozen=True)
class BackwardRoute:
    gemm: str = "blas"        # the gradient GEMMs' summation order (a MATMULS key)
    ds: str = "sub"           # dS = P∘(dP − D) ("sub") or P·dP − P·D ("dist")
    scale: str = "after"      # the scale applied to the result ("after") or folded into dS ("before")
    flash: str = "exp-64"     # the flash backward: exp or exp2, key/query tile width
    ftz: bool = False         # the flash backward flushes subnormal weights and dS to zero, as GPUs do

    def __str__(self) -> str:
        return f"gemm={self.gemm} ds={self.ds} scale={self.scale} flash={self.flash}{' ftz' if self.ftz else ''}"


BACKWARD_ROUTE_CHOICES = {"gemm": tuple(MATMULS), "ds": ("sub", "dist"), "scale": ("after", "before"),
                          "flash": FLASH_ROUTES}


def _flush_subnormals(x: np.ndarray) -> np.ndarray:
    return np.where(np.abs(x) < np.finfo(f32).tiny, f32(0), x)


def _ds(p, dp, d, route: str) -> np.ndarray:
    return p * (dp - d) if route == "sub" else p * dp - p * d


def _grads(p, ds, q, k, do, scale, route: BackwardRoute, bug: Optional[str]):
    """dQ, dK, dV in float32 from P, dS and the inputs along the route (bugs planted)."""
    mm = MATMULS[route.gemm]
    s = f32(1.0 if bug == "grad_unscaled" else scale)
    if route.scale == "before":
        ds_s = ds * s
        dq, dk = mm(ds_s, k), mm(np.ascontiguousarray(ds_s.T), q)
    else:
        dq, dk = mm(ds, k) * s, mm(np.ascontiguousarray(ds.T), q) * s
    pt = p if bug == "dV_untransposed_P" else np.ascontiguousarray(p.T)
    return dq, dk, mm(pt, do)


def backward_stage_path(head: Dict[str, np.ndarray], do, scale: float, causal: bool,
                        route: BackwardRoute = BackwardRoute(), bug: Optional[str] = None) -> Dict[str, np.ndarray]:
    """D, dP, dS, dQ, dK, dV in float32 from the head's own P (attention_weights) and output."""
    p, o, v, q, k = (head[n] for n in ("attention_weights", "output", "V", "Q", "K"))
    do = np.ascontiguousarray(do, dtype=f32)
    o_used = do if bug == "D_wrong_O" else o  # the bug: D from dO itself
    d = (do * o_used).sum(axis=1, keepdims=True, dtype=f32)
    dp = MATMULS[route.gemm](do, np.ascontiguousarray(v.T))
    ds = dp - d if bug == "dS_missing_P" else _ds(p, dp, d, route.ds)
    if bug == "dS_missing_P" and causal:
        ds = np.where(masked_where(*ds.shape), f32(0), ds)
    dq, dk, dv = _grads(p, ds, q, k, do, scale, route, bug)
    return {"dO": do.copy(), "D": d, "dP": dp, "dS": ds, "dQ": dq, "dK": dk, "dV": dv}


def flash_backward(q, k, v, do, o, lse, scale: float, causal: bool, route: BackwardRoute = BackwardRoute(),
                   bug: Optional[str] = None) -> Dict[str, np.ndarray]:
    """A FlashAttention-2 style backward in float32: D from the forward's output, then per key tile
    P recomputed from the logits and the saved lse, dV and dK accumulated over query tiles, dQ over
    key tiles (both orders of the two-kernel scheme, summed tile by tile)."""
    q, k, v, do, o, lse = (np.ascontiguousarray(x, dtype=f32) for x in (q, k, v, do, o, lse))
    use_exp2, block = parse_flash_route(route.flash)
    n, m = q.shape[0], k.shape[0]
    s_used = f32(1.0 if bug == "grad_unscaled" else scale)
    o_used = do if bug == "D_wrong_O" else o  # the bug: D from dO itself
    d = (do * o_used).sum(axis=1, keepdims=True, dtype=f32)
    dq = np.zeros(q.shape, f32)
    dk = np.zeros(k.shape, f32)
    dv = np.zeros(v.shape, f32)
    if bug == "bwd_lse_max":  # P = exp(S − m): the row maximum for the lse (log l left out)
        s_all = np.where(np.tril(np.ones((n, m), bool)) | (not causal), mm_blas(q, np.ascontiguousarray(k.T)) *
                         f32(scale), -np.inf)
        lse = s_all.max(axis=1, keepdims=True).astype(f32)
    for c0, r0 in ((c0, r0) for c0 in range(0, m, block) for r0 in range(0, n, block)):
        # (the bug's loop stopped after its first tile: dQ, or dK and dV, get no more terms)
        dq_stopped, kv_stopped = bug == "dq_first_key_tile" and c0 > 0, bug == "dkdv_first_query_tile" and r0 > 0
        kc, vc = k[c0:c0 + block], v[c0:c0 + block]
        with np.errstate(over="ignore"):  # masked logits may overflow exp before the mask zeroes them
            qr = q[r0:r0 + block]
            s = mm_blas(qr, np.ascontiguousarray(kc.T))
            if use_exp2 or bug == "bwd_lse_log2":
                lse2 = lse[r0:r0 + block] if bug == "bwd_lse_log2" else lse[r0:r0 + block] * LOG2E
                p = np.exp2(s * f32(scale * LOG2E) - lse2)
            else:  # (the bug: the scores recomputed under 1/d_k, the forward's lse right)
                p = np.exp(s * f32(1.0 / q.shape[1] if bug == "bwd_scores_1_over_d" else scale) - lse[r0:r0 + block])
            if route.ftz:
                p = _flush_subnormals(p)
            if causal and bug != "bwd_mask":
                rows = np.arange(r0, r0 + qr.shape[0])[:, None]
                cols = np.arange(c0, c0 + kc.shape[0])[None, :]
                p = np.where(cols > rows, f32(0), p)
            dor = do[r0:r0 + block]
            dp = mm_blas(dor, np.ascontiguousarray(vc.T))
            ds = dp - d[r0:r0 + block] if bug == "dS_missing_P" else _ds(p, dp, d[r0:r0 + block], route.ds)
            if route.ftz:
                ds = _flush_subnormals(ds)
            if bug == "dV_untransposed_P":  # dV = P·dO (N = M): query rows, key rows of dO
                dv[r0:r0 + block] += mm_blas(p, do[c0:c0 + block])
            elif bug == "dV_untransposed_tile":  # each tile of P untransposed (N, M multiples of the tile)
                dv[c0:c0 + block] += mm_blas(p, dor)
            elif not kv_stopped:
                pv = ds if bug == "dv_uses_ds" else p  # (dV = dSᵀ·dO: dS where P belongs)
                dv[c0:c0 + block] += mm_blas(np.ascontiguousarray(pv.T), dor)
            if bug == "dk_untransposed_tile":  # each tile of dS untransposed (N, M multiples of the tile)
                dk[c0:c0 + block] += mm_blas(ds, qr) * s_used
            elif not kv_stopped:
                dk[c0:c0 + block] += mm_blas(np.ascontiguousarray(ds.T), qr) * s_used
            other = vc if bug == "dq_uses_v" else kc  # (dQ = dS·V: V where K belongs)
            if bug == "dq_key_rows":  # dQ[k0 + r] where dQ[q0 + r] belongs
                end = min(c0 + qr.shape[0], n)
                dq[c0:end] += (mm_blas(ds, kc) * s_used)[:end - c0]
            elif not dq_stopped:
                dq[r0:r0 + block] += mm_blas(ds, other) * s_used
    return {"flash_dQ": dq, "flash_dK": dk, "flash_dV": dv}


def compute_backward(head: Dict[str, np.ndarray], do, scale: float, causal: bool,
                     route: BackwardRoute = BackwardRoute(), bug: Optional[str] = None) -> None:
    """Adds the backward stages of one head (computed by compute_head) to it, in float32."""
    head.update(backward_stage_path(head, do, scale, causal, route, bug))
    if "flash_output" in head:
        head.update(flash_backward(head["Q"], head["K"], head["V"], do, head["flash_output"], head["flash_lse"],
                                   scale, causal, route, bug))
    for name in list(head):
        head[name] = np.ascontiguousarray(head[name], dtype=f32)
