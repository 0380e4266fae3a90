"""flash_output and flash_lse: the FlashAttention forward from Q, K, V (tiled, online softmax), and
the natural-log log-sum-exp of each row of the scores the softmax reads.

Their bounds follow the online softmax (verify/model/flash.py): the logits' dot-product error and
the variant's score modifications, the exponents, the running sums' rescales per key tile, the
final division (and a split-KV combine), and, per arithmetic, a folded scale·log2e factor and
tensor-core truncation. Each is also checked against the stage path where the binary wrote it:
flash_output against its output, flash_lse against the log-sum-exp of its QK_scaled; when they
disagree and the stage-path stage has failed already, the flash stage is not blamed.

A row that sees no key has flash_output 0 and flash_lse −inf; a program's +inf there is read as
−inf (flash-attn stores +inf, so that its backward recomputes P = 0). Under causal ALiBi a
flash_lse row that exceeds the reference by slope·diag(i) (flash-attn's causal kernel adds slope·j,
which the softmax does not see) is read shifted back: flash_lse's `canonical`.
"""
from __future__ import annotations

from dataclasses import replace
from typing import List

import numpy as np

from ..model.arrays import concat_rows, float64, isfinite, like, namespace, target, to_device, to_numpy
from ..model.attention import log_sum_exp_rows, softmax_and_lse
from ..model.flash import flash_forward_rows, flash_lse_sums
from ..model.rounding import FLUSH, ROUND_VAR, ULP_IN_U, finite_abs, memo
from ..model.scores import as_head
from ..model.tiles import flush_max, in_order, stack_over_rows
from ..model.softmax import need, scaled_logits, softmax_parts
from ..stages import FLASH_LSE, FLASH_OUTPUT, INPUT_NAMES, KEYS, OUTPUT, QUERIES, SCALED_SCORES, STAGES, VALUES
from ..variant import Variant
from .base import (FLASH_VS_OUTPUT, LSE_VS_SCORES, HeadContext, Problem, StageSpec, Violation, consistency,
                   flash_sources, head_variant, score_sources)
from .copies import PATTERNS
from .output import attention_from_inputs, scores_from_inputs, values_floor
from .scores import qk_quantization, stand_ins


def _with_mask_output(src, scale, masked, variant: Variant = Variant(), slope: float = 0.0, rows=None, n=None):
    return attention_from_inputs(src, scale, masked, variant, slope, rows, n)


def _with_mask_lse(src, scale, masked, variant: Variant = Variant(), slope: float = 0.0, rows=None, n=None):
    return log_sum_exp_rows(scores_from_inputs(src, scale, masked, variant, slope, rows, n))


def _qk_flush_max(src) -> float:
    return flush_max(src[QUERIES], np.asarray(src[KEYS]).T)


def _output_isolated(src, ref, problem: Problem):
    Q, K, V = need(src, FLASH_OUTPUT, QUERIES, KEYS, VALUES)
    return memo(problem.cache, "flash_output var", (Q, K, V), _output_key(*problem.model_args[:4]),
                lambda: _forward_rows(Q, K, V, problem))


def _output_key(scale, head, u, kernel) -> tuple:
    """What flash_output's (variance, one-signed part) depends on besides Q, K, V (Problem.key)."""
    head = as_head(head)
    return scale, head.causal, u, kernel, head


def _forward_rows(Q, K, V, problem: Problem):
    """flash_output's (variance, one-signed part), computed in the same pass over the row tiles
    as flash_lse's row sums, which the head's cache keeps for flash_lse's bound (lse_var_det)."""
    scale, head, u, kernel, cache = problem.model_args
    if on_device_of(as_head(head)):
        # Q, K, V moved to the device once; the row results (N×d and N×1) come back once.
        out, sums = flash_forward_rows(to_device(Q), to_device(K), to_device(V), scale, head, u, kernel, None)
        out, sums = tuple(map(_numpy, out)), tuple(map(_numpy, sums))
    else:
        out, sums = flash_forward_rows(Q, K, V, *problem.model_args)
    memo(cache, "flash_lse sums", (Q, K), (scale, as_head(head), u, kernel), lambda: sums)
    return out


def share_forward(cache, Q, K, V, scale, head, u, kernel, out, sums) -> None:
    """Keep in the head's cache flash_output's (variance, one-signed part) and flash_lse's row sums
    of Q, K, V where another pass over the row tiles computed them (the flash backward's chain,
    whose tiles compute the forward's parts anyway): the forward stages' bounds then take them
    from there instead of computing each tile's logits and softmax once more."""
    memo(cache, "flash_output var", (Q, K, V), _output_key(scale, head, u, kernel), lambda: tuple(out))
    memo(cache, "flash_lse sums", (Q, K), (scale, as_head(head), u, kernel), lambda: tuple(sums))


def _numpy(x):
    """A device's result as NumPy (a scalar as it is)."""
    return x if isinstance(x, (float, int)) else to_numpy(x)


def lse_var_det(Q, K, lse, scale, head, u, kernel, cache):
    """(variance, one-signed part) of the flash forward's lse error, lse its value: Δlse =
    Σ_j p_j η_j + Δl/l, then log (≤ kernel.log_ulps ulp of log l) and the roundings of values of
    lse's magnitude (m + log l; on the GPU the log2-domain conversions; under causal ALiBi raised
    by flash-attn's shift slope·diag(i)). A row that sees no key: 0 (its lse is exact)."""
    head = as_head(head)
    m, eta_sum, l_var, det = forward_sums(Q, K, scale, head, u, kernel, cache)
    xp = namespace(lse)
    finite = isfinite(lse)
    lse = xp.where(finite, lse, 0.0)
    log_l = xp.where(finite, lse - m, 0.0)
    magnitude = xp.abs(m) + xp.abs(lse)
    shift = head.flash_shift(Q.shape[0], K.shape[0])
    if shift is not None:
        magnitude = magnitude + like(magnitude, 2 * np.abs(shift))
    var = (eta_sum + l_var
           + ROUND_VAR * u * u * ((kernel.log_ulps * ULP_IN_U * log_l) ** 2
                                  + kernel.lse_roundings * magnitude ** 2 / 4)
           + kernel.log_abs ** 2 / 3)
    return xp.where(finite, var, 0.0), det


def forward_sums(Q, K, scale, head, u, kernel, cache) -> tuple:
    """flash_lse's row sums of Q, K (flash_lse_sums), kept in the head's cache."""
    head = as_head(head)
    return memo(cache, "flash_lse sums", (Q, K), (scale, head, u, kernel),
                lambda: flash_lse_sums(Q, K, scale, head, u, kernel, cache))


def _lse_isolated(src, ref, problem: Problem):
    Q, K = need(src, FLASH_LSE, QUERIES, KEYS)
    return lse_var_det(Q, K, ref, *problem.model_args)


def _logit_moves(src, q, problem: Problem):
    """The logits' move when Q or K is known only to within its printed resolution, and p."""
    scale, head = problem.scale, problem.head
    dS = np.broadcast_to(abs(scale) * qk_quantization(src, q, problem), (np.shape(src[QUERIES])[0],
                                                                        np.shape(src[KEYS])[0]))
    Q, K = np.asarray(src[QUERIES], np.float64), np.asarray(src[KEYS], np.float64)
    S = scaled_logits(Q, K, scale, head)
    slope = head.cap_slope((Q @ K.T) * scale)
    p = softmax_parts(S)[0]
    return p * (dS if slope is None else dS * slope), p


def _query_rows(src, q, problem: Problem, compute):
    """compute(src, q, problem) row tile by row tile of the queries (their quanta with them)."""
    Q = np.asarray(src[QUERIES])
    n, m = Q.shape[0], np.shape(src[KEYS])[0]
    head = problem.head

    def tile(r):
        if r is None:
            return compute(src, q, problem)
        qt = {k: (np.broadcast_to(v, Q.shape)[r] if k == QUERIES else v) for k, v in q.items()}
        moved = compute({**src, QUERIES: Q[r]}, qt, replace(problem, tensors=head.rows_of(r.start, r.stop, n)))
        return np.broadcast_to(moved, (r.stop - r.start, np.shape(moved)[-1]))
    return stack_over_rows(n, m, Q.shape[1], tile)


def _output_quantization(src, q, problem: Problem):
    return _query_rows(src, q, problem, _output_moves) if q else 0.0


def _output_moves(src, q, problem: Problem):
    head = problem.head
    w, p = _logit_moves(src, q, problem)
    O = head.dropped(p) @ src[VALUES]
    moved = head.dropped(w) @ np.abs(src[VALUES]) + np.abs(O) * w.sum(axis=1, keepdims=True)
    return moved + (head.dropped(p) @ q[VALUES] if VALUES in q else 0.0)


def _lse_quantization(src, q, problem: Problem):
    return _query_rows(src, q, problem, lambda s, qt, p: _logit_moves(s, qt, p)[0].sum(axis=1, keepdims=True)) \
        if q else 0.0


def _lse_canonical(got: np.ndarray, ref: np.ndarray, ctx: HeadContext) -> np.ndarray:
    """flash_lse as the reference writes it: −inf for a row that sees no key where the program
    wrote +inf; under causal ALiBi, each row that lies nearer the reference shifted back by
    flash-attn's slope·diag(i) (HeadVariant.flash_shift) than as written, shifted back."""
    got = np.where((ref == -np.inf) & (got == np.inf), -np.inf, got)
    shift = ctx.head().flash_shift(got.shape[0], ctx.dims.seq_k)
    if shift is None:
        return got
    with np.errstate(invalid="ignore"):
        nearer = np.abs(got - shift - ref) < np.abs(got - ref)
    return np.where(nearer, got - shift, got)


def _flash_sources(ctx: HeadContext):
    src = {n: np.asarray(ctx.inputs[n], dtype=np.float64) for n in INPUT_NAMES}
    src.update(ctx.variant_tensors())
    return src


def _partner_reference(ctx: HeadContext, names):
    """The reference chain of `names` from the head's inputs (the caller's when it has them)."""
    if all(n in ctx.chain for n in names):
        return {n: ctx.chain[n] for n in names}
    return ctx.bounds.reference_chain(_flash_sources(ctx), ctx.scale, ctx.causal, names,
                                      variant=ctx.effective_variant, slope=ctx.slope)


def _output_vs_partner(stage: str, got: np.ndarray, ctx: HeadContext) -> List[Violation]:
    """|flash_output - output| ≤ bound(flash_output) + chained bound(output), both from Q, K, V."""
    partner = SPECS_BY_NAME[stage].partner
    if partner not in ctx.got:
        return []
    src = _flash_sources(ctx)
    chain = _partner_reference(ctx, list(INPUT_NAMES) + [partner])
    kw = ctx.bound_args()
    allowed = (ctx.bounds.stage_bound(stage, src, chain[partner], **kw) + ctx.bounds.combine_allowance(stage, ctx)
               + ctx.bounds.chained_bound(partner, {**src, **chain}, **kw) + ctx.quantum(stage, partner))
    v = consistency(FLASH_VS_OUTPUT, stage, got, np.asarray(ctx.got[partner], np.float64), allowed,
                    f"the program's {partner}")
    return [v] if v else []


def _lse_vs_partner(stage: str, got: np.ndarray, ctx: HeadContext) -> List[Violation]:
    """|flash_lse - logsumexp(QK_scaled)| ≤ bound(flash_lse) + Σ_j p_j·bound(QK_scaled)_j."""
    partner = SPECS_BY_NAME[stage].partner
    if partner not in ctx.got:
        return []
    hidden = ctx.hidden(*np.shape(ctx.got[partner]))
    # (a finite stand-in for −inf is −inf to the softmax: a row that sees no key has log 0 = −inf)
    scores = np.asarray(ctx.got[partner], np.float64)
    scores = np.where(stand_ins(scores, hidden), -np.inf, scores)
    empty = hidden.all(axis=1)
    if not (np.isfinite(scores) | (scores == -np.inf)).all() or ((scores == -np.inf).all(axis=1) & ~empty).any():
        return []  # the scores' own check reports it
    weights = next(s for s in STAGES if partner in STAGES[s].inputs)
    chain = _partner_reference(ctx, list(INPUT_NAMES) + [partner, weights, stage])
    got = _lse_canonical(got, chain[stage], ctx)
    kw = ctx.bound_args()
    s_bound = ctx.bounds.chained_bound(partner, {**_flash_sources(ctx), **chain}, **kw) + ctx.quantum(partner)
    inherited = (chain[weights] * s_bound).sum(axis=1, keepdims=True) + ctx.quantum(stage)
    allowed = (ctx.bounds.stage_bound(stage, _flash_sources(ctx), chain[stage], **kw)
               + ctx.bounds.combine_allowance(stage, ctx) + inherited)
    v = consistency(LSE_VS_SCORES, stage, got, log_sum_exp_rows(scores), allowed,
                    f"the log-sum-exp of the program's {partner} rows")
    return [v] if v else []


def _reference(with_mask):
    def reference(src, problem: Problem):
        head = problem.head
        if on_device_of(head):  # Q, K, V moved to the check's device once, the result back once
            src = {k: (to_device(v) if k in INPUT_NAMES else v) for k, v in src.items()}
        Q = src[QUERIES] if on_device_of(head) else np.asarray(src[QUERIES])
        n = Q.shape[0]
        out = stack_over_rows(n, src[KEYS].shape[0], Q.shape[1], lambda r: (
            with_mask(src, problem.scale, None, head.variant, head.slope) if r is None else
            with_mask({**src, QUERIES: Q[r]}, problem.scale, None, head.variant, head.slope, r, n)))
        return to_numpy(out)
    return reference


# The last flash_output reference's log-sum-exp, computed from the same scores: (its sources' key,
# the sources, the lse). flash_lse's reference from the same Q, K (and mask) comes next in a chain.
_LAST_LSE: List[tuple] = []


def _lse_key(src, problem: Problem) -> tuple:
    """What flash_lse's reference from src depends on: its sources but V, by identity, the problem,
    the device it is computed on."""
    return (tuple((k, id(v)) for k, v in sorted(src.items()) if k != VALUES), problem.scale, problem.head,
            on_device_of(problem.head) and target())


def _output_reference(src, problem: Problem):
    """flash_output's reference, a row tile at a time, with flash_lse's from the same tiles' scores
    and exponentials (kept for flash_lse's reference: _lse_reference)."""
    head, host = problem.head, src
    if on_device_of(head):  # Q, K, V moved to the check's device once, the results back once
        src = {k: (to_device(v) if k in INPUT_NAMES else v) for k, v in src.items()}
    Q = src[QUERIES] if on_device_of(head) else np.asarray(src[QUERIES])
    n, lse = Q.shape[0], []

    def tile(r):
        part = src if r is None else {**src, QUERIES: Q[r]}
        scores = scores_from_inputs(part, problem.scale, None, head.variant, head.slope, r, None if r is None else n)
        p, row_lse = softmax_and_lse(scores)
        in_order(lambda: lse.append(row_lse))  # (the tiles' rows in order, whatever thread computed them)
        return head_variant(head.variant, head.slope, part).dropped(p, r) @ float64(part[VALUES])
    out = to_numpy(stack_over_rows(n, src[KEYS].shape[0], Q.shape[1], tile))
    _LAST_LSE[:] = [(_lse_key(host, problem), host, to_numpy(concat_rows(lse)))]
    return out


def _lse_reference(src, problem: Problem):
    """flash_lse's reference: the last flash_output reference's where it came from the same sources."""
    last = _LAST_LSE[0] if _LAST_LSE else None  # (read once: another thread may replace it)
    if last is not None and last[0] == _lse_key(src, problem):
        return last[2]
    return _reference(_with_mask_lse)(src, problem)


def on_device_of(head) -> bool:
    """Whether this head's flash references run on the check's device (verify/model/arrays.py):
    a device is chosen and the variant is one the device path computes (the mask, windows,
    grouped heads; the softcap, ALiBi, bias files and dropout stay with NumPy)."""
    return target() is not None and not head.modifies and head.dropout == 0


SPECS = (
    StageSpec(FLASH_OUTPUT, reference=_output_reference, isolated=_output_isolated,
              floor=lambda src: (values_floor(src[VALUES])
                                 + _qk_flush_max(src) * np.max(finite_abs(src[VALUES]), initial=0.0)),
              quantization=_output_quantization, invariants=(_output_vs_partner,), scaled=True,
              partner=OUTPUT, given_partner=(FLASH_VS_OUTPUT,), with_mask=_with_mask_output,
              from_inputs=_with_mask_output,
              diagnoses=PATTERNS + ("scaled", "mask", "keys", "overflow", "mask_after_softmax", "softmax_axis",
                                    "tile_keys", "key_tile", "online_rescale", "normalization"),
              baseline=OUTPUT, variant_sources=flash_sources, stands_for=OUTPUT),
    StageSpec(FLASH_LSE, reference=_lse_reference, isolated=_lse_isolated, keyless=-np.inf,
              floor=lambda src: FLUSH * 2 * np.asarray(src[KEYS]).shape[0] + _qk_flush_max(src),
              quantization=_lse_quantization, invariants=(_lse_vs_partner,), scaled=True, partner=SCALED_SCORES,
              given_partner=(LSE_VS_SCORES,),
              with_mask=_with_mask_lse, from_inputs=_with_mask_lse,
              diagnoses=PATTERNS + ("scaled", "mask", "lse_log2", "keys", "overflow", "softmax_axis",
                                    "tile_keys", "key_tile", "online_rescale", "normalization"),
              variant_sources=score_sources, canonical=_lse_canonical),
)
SPECS_BY_NAME = {s.name: s for s in SPECS}
