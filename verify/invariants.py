"""Checks that need no reference: properties every correct result has, on one head's got-matrix.

softmax rows are non-negative and sum to 1 (within the row sum's rounding bound), masked entries are
exactly 0 (weights) or exactly -inf (scaled scores), KT is an exact transpose of the binary's K,
the Q/K/V echoes are bit-exact copies of the input files, flash_output agrees with the binary's own
output and flash_lse with the log-sum-exp of its QK_scaled (within the tolerance model), and no
NaN/Inf appears where none is allowed.

ctx (from verify.compare): "dims", "scale", "causal", "precision", and where available "input"
(the input file's matrix for an echo stage), "K_got" (the binary's K, else the input K),
"output_got", "QK_scaled_got", and "inputs" ({"Q", "K", "V"} float64) or "Q_got"/"V_got": the
flash consistency checks need Q, K, V for their bound and are skipped without them. "backend"
(run.toml's) is optional and picks the tolerance model's arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

from . import tolerance
from .reference import causal_mask, log_sum_exp_rows
from .stages import INPUT_NAMES

# Violation codes: the ones that describe the same fault as a diagnosis share its code.
NONFINITE = "nonfinite"
NEGATIVE_WEIGHTS = "negative_weights"
ROW_SUM = "row_sum"
MASK_MISSING = "mask_missing"           # a masked weight is not 0 / a masked score not -inf
NOT_TRANSPOSE = "not_transpose"
ECHO_MISMATCH = "echo_mismatch"
FLASH_VS_OUTPUT = "flash_vs_output"
LSE_VS_SCORES = "lse_vs_scores"


@dataclass
class Violation:
    code: str
    message: str
    count: int
    where: Optional[Tuple[int, ...]]


def _first(mask: np.ndarray) -> Optional[Tuple[int, ...]]:
    idx = np.argwhere(mask)
    return tuple(int(i) for i in idx[0]) if len(idx) else None


def _at(where: Optional[Tuple[int, ...]]) -> str:
    return f"[{', '.join(map(str, where))}]" if where else ""


def _violation(code: str, stage: str, bad: np.ndarray, what: str) -> Optional[Violation]:
    """One Violation for the True entries of `bad`, or None when there are none."""
    count = int(np.count_nonzero(bad))
    if not count:
        return None
    where = _first(bad)
    return Violation(code, f"{stage}: {count} of {bad.size} entries {what}; first at {_at(where)}",
                     count, where)


def _masked(stage_shape: Tuple[int, int], causal: bool) -> np.ndarray:
    return causal_mask(*stage_shape) if causal else np.zeros(stage_shape, dtype=bool)


def _nonfinite(stage: str, got: np.ndarray, allowed_neg_inf: np.ndarray) -> Optional[Violation]:
    nan = np.isnan(got)
    inf = np.isinf(got) & ~(allowed_neg_inf & (got == -np.inf))
    bad = nan | inf
    if not bad.any():
        return None
    where = _first(bad)
    return Violation(NONFINITE, f"{stage}: {int(nan.sum())} NaN and {int(inf.sum())} Inf where none "
                     f"is allowed; first at {_at(where)} = {float(got[where])}", int(bad.sum()), where)


def _softmax_checks(got: np.ndarray, ctx: dict) -> List[Violation]:
    out: List[Violation] = []
    masked = _masked(got.shape, bool(ctx.get("causal")))
    finite = np.isfinite(got)
    v = _violation(NEGATIVE_WEIGHTS, "attention_weights", finite & (got < 0), "are negative")
    if v:
        out.append(v)
    v = _violation(MASK_MISSING, "attention_weights", masked & finite & (got != 0),
                   "above the diagonal are not 0 although causal masking is on")
    if v:
        out.append(v)
    rows_ok = finite.all(axis=1)
    if rows_ok.any():
        p = np.where(finite, got, 0.0)
        u = tolerance.unit_roundoff(ctx.get("precision", "fp32"))
        # The exp errors cancel in Σ_j p_j; what remains is the row sum's rounding (ε_l) and the
        # final roundings of each weight: the model's variances, evaluated on got itself.
        var = (tolerance._rowsum_rel_var(np.clip(p, 0.0, None), u)[:, 0]
               + tolerance.SOFTMAX_FINAL_ROUNDINGS * tolerance.ROUND_VAR * u * u * (p * p).sum(axis=1))
        allowed = tolerance.LAMBDA * np.sqrt(var) + 2 * tolerance.FLUSH * got.shape[1]
        q = ctx.get("quantum")
        if q is not None:  # the printed resolution of every weight of the row
            allowed = allowed + np.where(finite, q, 0.0).sum(axis=1)
        dev = np.abs(p.sum(axis=1) - 1.0)
        bad = rows_ok & ~(dev <= allowed)
        if bad.any():
            r = int(np.argmax(np.where(bad, dev, -1.0)))
            out.append(Violation(ROW_SUM, f"attention_weights: {int(bad.sum())} of {got.shape[0]} rows "
                                 f"do not sum to 1; worst row {r} sums to {p[r].sum():.9g} (allowed "
                                 f"±{allowed[r]:.2g})", int(bad.sum()), (r,)))
    return out


def _flash_src(ctx: dict) -> Optional[Dict[str, np.ndarray]]:
    inputs = ctx.get("inputs")
    if inputs is not None and all(n in inputs for n in INPUT_NAMES):
        return {n: np.asarray(inputs[n], dtype=np.float64) for n in INPUT_NAMES}
    parts = {"Q": ctx.get("Q_got"), "K": ctx.get("K_got"), "V": ctx.get("V_got")}
    if all(x is not None for x in parts.values()):
        return {n: np.asarray(x, dtype=np.float64) for n, x in parts.items()}
    return None


def _consistency(code: str, stage: str, got: np.ndarray, other: np.ndarray, allowed: np.ndarray,
                 other_name: str) -> Optional[Violation]:
    if other.shape != got.shape:
        return Violation(code, f"{stage} is {got.shape[0]}x{got.shape[1]} but {other_name} is "
                         f"{other.shape[0]}x{other.shape[1]}", 1, None)
    with np.errstate(invalid="ignore"):
        # Both NaN: where allowed non-finite inputs made the references NaN too (else the
        # non-finite check has failed the stage already), the two agree.
        diff = np.where((got == other) | (np.isnan(got) & np.isnan(other)), 0.0, np.abs(got - other))
    diff = np.where(np.isnan(diff), np.inf, diff)  # NaN disagrees most, and must be locatable
    bad = ~(diff <= allowed)
    if not bad.any():
        return None
    where = _first(np.where(bad, diff, -1.0) == np.max(np.where(bad, diff, -1.0)))
    return Violation(code, f"{stage} disagrees with {other_name} at {int(bad.sum())} of {bad.size} "
                     f"entries beyond both stages' error bounds; worst at {_at(where)}: "
                     f"{got[where]:.9g} vs {other[where]:.9g}", int(bad.sum()), where)


def _reference(ctx: dict, src: Dict[str, np.ndarray], names: List[str]) -> Dict[str, np.ndarray]:
    """The reference chain of `names` from `src`: the caller's (ctx "chain", computed from
    ctx "inputs") when src is those inputs and it has them all, else computed here."""
    chain, inputs = ctx.get("chain"), ctx.get("inputs")
    if (chain is not None and inputs is not None and all(n in chain for n in names)
            and all(src[n] is inputs[n] for n in src)):
        return {n: chain[n] for n in names}
    from .reference import reference_chain
    return reference_chain(src, float(ctx["scale"]), bool(ctx["causal"]), names)


def _bound_args(ctx: dict) -> dict:
    """The tolerance model's keyword arguments (ctx "tolerance_cache": the head's HeadCache)."""
    return dict(scale=float(ctx["scale"]), causal=bool(ctx["causal"]),
                precision=ctx.get("precision", "fp32"), backend=ctx.get("backend"),
                math=ctx.get("math", "ieee"), cache=ctx.get("tolerance_cache"))


def _quanta(ctx: dict, *stages: str):
    """The sum of the printed resolutions of `stages` (ctx "quanta"; 0 where exact)."""
    total = 0.0
    for s in stages:
        q = (ctx.get("quanta") or {}).get(s)
        if q is not None:
            total = total + q
    return total


def _flash_output_check(got: np.ndarray, ctx: dict) -> Optional[Violation]:
    """|flash_output - output| ≤ bound(flash_output) + chained bound(output), both from Q, K, V."""
    output_got, src = ctx.get("output_got"), _flash_src(ctx)
    if output_got is None or src is None:
        return None
    kw = _bound_args(ctx)
    chain = _reference(ctx, src, ["Q", "K", "V", "output"])
    ref = chain["output"]
    allowed = (tolerance.stage_bound("flash_output", src, ref, **kw)
               + tolerance.chained_bound("output", chain, **kw) + _quanta(ctx, "flash_output", "output"))
    return _consistency(FLASH_VS_OUTPUT, "flash_output", got, np.asarray(output_got, np.float64),
                        allowed, "the binary's output")


def _flash_lse_check(got: np.ndarray, ctx: dict) -> Optional[Violation]:
    """|flash_lse - logsumexp(QK_scaled_got)| ≤ bound(flash_lse) + Σ_j p_j·bound(QK_scaled)_j."""
    scores, src = ctx.get("QK_scaled_got"), _flash_src(ctx)
    if scores is None or src is None:
        return None
    scores = np.asarray(scores, np.float64)
    if not (np.isfinite(scores) | (scores == -np.inf)).all() or (scores == -np.inf).all(axis=1).any():
        return None  # QK_scaled's own check reports it
    kw = _bound_args(ctx)
    chain = _reference(ctx, src, ["Q", "K", "V", "QK_scaled", "attention_weights", "flash_lse"])
    s_bound = tolerance.chained_bound("QK_scaled", chain, **kw)
    s_bound = s_bound + _quanta(ctx, "QK_scaled")
    inherited = (chain["attention_weights"] * s_bound).sum(axis=1, keepdims=True) + _quanta(ctx, "flash_lse")
    allowed = tolerance.stage_bound("flash_lse", src, chain["flash_lse"], **kw) + inherited
    return _consistency(LSE_VS_SCORES, "flash_lse", got, log_sum_exp_rows(scores), allowed,
                        "the log-sum-exp of the binary's QK_scaled rows")


def _where_reference_finite(stage: str, got: np.ndarray, ctx: dict) -> np.ndarray:
    """got, with 0 where non-finite inputs (allowed by ctx["allow_nonfinite"]) made the reference
    non-finite: the comparisons judge those elements, the non-finite check the others."""
    ref = ctx.get("chain", {}).get(stage) if ctx.get("allow_nonfinite") else None
    return got if ref is None else np.where(np.isfinite(ref), got, 0.0)


def check_invariants(stage: str, got: np.ndarray, ctx: dict) -> List[Violation]:
    """Reference-free checks on one head's float64 got-matrix of `stage` (see the module doc)."""
    got = np.asarray(got, dtype=np.float64)
    causal = bool(ctx.get("causal"))
    out: List[Violation] = []
    neg_inf_ok = _masked(got.shape, causal) if stage == "QK_scaled" else np.zeros(got.shape, bool)

    if stage in INPUT_NAMES:
        want = ctx.get("input")
        if want is not None:
            want = np.asarray(want, dtype=np.float64)
            if want.shape != got.shape:
                out.append(Violation(ECHO_MISMATCH, f"{stage}: the echo is {got.shape[0]}x{got.shape[1]}"
                                     f" but the input file is {want.shape[0]}x{want.shape[1]}", 1, None))
                return out
            q = ctx.get("quantum")
            with np.errstate(invalid="ignore"):
                near = (np.abs(got - want) <= q) if q is not None else np.zeros(got.shape, bool)
            differ = ~((got == want) | (np.isnan(got) & np.isnan(want)) | near)
            v = _violation(ECHO_MISMATCH, stage, differ, "differ from the input file (must be bit-exact)"
                           if q is None else "differ from the input file by more than the printed resolution")
            if v:
                out.append(v)
            # a non-finite input (--allow-nonfinite) echoes as such: the echo check judges it
            v = _nonfinite(stage, np.where(np.isfinite(want), got, 0.0), neg_inf_ok)
            if v:
                out.append(v)
            return out

    v = _nonfinite(stage, _where_reference_finite(stage, got, ctx), neg_inf_ok)
    if v:
        out.append(v)
    if stage == "KT":
        K = ctx.get("K_got")
        if K is not None:
            K = np.asarray(K, dtype=np.float64)
            if K.T.shape != got.shape:
                out.append(Violation(NOT_TRANSPOSE, f"KT is {got.shape[0]}x{got.shape[1]} but K is "
                                     f"{K.shape[0]}x{K.shape[1]}: not its transpose", 1, None))
            else:
                qk = (ctx.get("quanta") or {}).get("K")
                q = _quanta(ctx, "KT") + (qk.T if qk is not None else 0.0)
                with np.errstate(invalid="ignore"):
                    same = (got == K.T) | (np.isnan(got) & np.isnan(K.T)) | (np.abs(got - K.T) <= q)
                v = _violation(NOT_TRANSPOSE, "KT", ~same, "differ from K transposed (must be bit-exact)"
                               if np.ndim(q) == 0 else "differ from K transposed by more than the printed "
                               "resolution")
                if v:
                    out.append(v)
    elif stage == "QK_scaled" and causal:
        masked = _masked(got.shape, True)
        v = _violation(MASK_MISSING, "QK_scaled", masked & (got != -np.inf) & ~np.isnan(got),
                       "above the diagonal are not -inf although causal masking is on")
        if v:
            out.append(v)
    elif stage == "attention_weights":
        out.extend(_softmax_checks(got, ctx))
    elif stage == "flash_output" and not out:
        v = _flash_output_check(got, ctx)
        if v:
            out.append(v)
    elif stage == "flash_lse" and not out:
        v = _flash_lse_check(got, ctx)
        if v:
            out.append(v)
    return out
