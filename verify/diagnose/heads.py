"""Heads mixed up: a stage holding another head's result, a query head that read another K/V head
than its group's (GQA/MQA: the map h % Hk, or K/V heads not shared), and a K/V head's dK or dV not
summed over its group's query heads, or summed twice, or K read from one head and V from another.
Hypotheses of verify/diagnose/hypotheses.py ("head_permuted": the specs list it for every stage).
other_head_stage gives another query head's stage, for a bug that read an operand off by a head
(verify/diagnose/backward.py: D from another head's O); group_sum a K/V head's dK or dV as the sum
over some query heads, under the case's variant or another mask (verify/diagnose/masks.py).

Codes: head_permuted, kv_head_map, kv_group_not_summed, kv_group_summed_twice, operand_head.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..check.diagnosis import Diagnosis, Suspect
from ..check.reference import reference_chain
from ..specs import SPECS
from ..stages import GRAD_OUTPUT, KEYS, KEYS_T, QUERIES, STAGES, VALUES, Dims
from ..variant import NONE, PER_HEAD, Variant
from .base import MATCH_WIDTHS, MAX_HEADS_SEARCHED, explains, explains_closely
from .inputs import alternatives, variant_of, variant_tensors

CODES = ("head_permuted", "kv_head_map", "kv_group_not_summed", "kv_group_summed_twice", "operand_head")


def head_permuted(stage, got, want, ctx, width) -> List[Diagnosis]:
    """got is another head's reference (a query head's, or a K/V head's for a stage of the K/V heads)."""
    ref_of_head: Optional[Callable[[int], np.ndarray]] = ctx.ref_of_head
    dims, head = ctx.dims, ctx.head
    kv = STAGES[stage].kv
    heads = (dims.total_kv_heads if kv else dims.total_heads) if dims is not None else 0
    if ref_of_head is None or head is None or heads < 2:
        return []
    # Another head's reference comes from the reference chain: allow the chained error as well.
    loose = 4.0 * width + 1e-5 * float(np.max(np.abs(want[np.isfinite(want)]), initial=0.0))
    for h in range(min(heads, MAX_HEADS_SEARCHED)):
        if h == head:
            continue
        other = np.asarray(ref_of_head(h), dtype=np.float64)
        if other.shape != got.shape:
            continue
        diff = explains(got, other, want, loose / MATCH_WIDTHS)
        if diff is not None:
            b, hh = divmod(h, dims.kv) if kv else dims.decode_head(h)
            what = "K/V head" if kv else "head"
            return [Diagnosis("head_permuted", f"{stage} {what} {head} holds {what} {h}'s result (batch "
                              f"{b}, {what} {hh}): max diff {diff:.2g} from its reference",
                              {"matches_head": h, "batch": b, "head_in_batch": hh, "kv_head": kv,
                               "max_diff": diff}, 0.95)]
    return []


# ---- the K/V head a query head reads -------------------------------------------------------------

def _kv_inputs(ctx: Suspect, kv_head: int) -> Optional[Dict[str, np.ndarray]]:
    """K/V head `kv_head`'s K, V (and Kᵀ), from the inputs of the first query head that reads it."""
    first = ctx.dims.query_heads_of(kv_head)[0]
    x = ctx.inputs_of_head(first)
    k, v = np.asarray(x[KEYS], np.float64), np.asarray(x[VALUES], np.float64)
    return {KEYS: k, VALUES: v, KEYS_T: k.T}


def _maps(dims: Dims, head: int, read: int) -> List[Tuple[str, str]]:
    """(name, words) of every wrong map under which query head `head` reads K/V head `read`."""
    b, h = dims.decode_head(head)
    out = []
    if read == b * dims.kv + h % dims.kv:
        out.append(("modulo", f"the map h % Hk = {h} % {dims.kv} (interleaved) instead of h // (H/Hk) = "
                              f"{h} // {dims.group_size}"))
    if read == head:
        out.append(("unshared", "K/V head i for query head i: the K/V heads not shared"))
    elif head >= dims.total_kv_heads and read == dims.total_kv_heads - 1:
        out.append(("unshared_clamped", f"the last K/V head: query head {head} is past the last of "
                                        f"{dims.total_kv_heads} K/V heads, as if K/V heads were not shared "
                                        "(index clamped)"))
    return out or [("other", "another group's K/V head")]


def _read_order(dims: Dims, head: int) -> Iterator[int]:
    """The K/V heads a query head may have read by mistake, the usual wrong maps' first."""
    b, h = dims.decode_head(head)
    usual = [b * dims.kv + h % dims.kv, head, dims.total_kv_heads - 1]
    rest = range(min(dims.total_kv_heads, MAX_HEADS_SEARCHED))
    own = dims.kv_head_of(head)
    for j in dict.fromkeys([j for j in usual if 0 <= j < dims.total_kv_heads] + list(rest)):
        if j != own:
            yield j


def kv_head_map(stage, got, want, ctx, width) -> List[Diagnosis]:
    """A query head's stage computed with another K/V head's K and V than its group's."""
    dims, head = ctx.dims, ctx.head
    if (dims is None or head is None or STAGES[stage].kv or dims.group_size < 2
            or ctx.inputs_of_head is None):
        return []
    for j in _read_order(dims, head):
        for cand, w in alternatives(stage, ctx, width, replace=_kv_inputs(ctx, j)):
            diff = explains_closely(got, cand, want, w)
            if diff is None:
                continue
            own = dims.kv_head_of(head)
            maps = _maps(dims, head, j)
            return [Diagnosis("kv_head_map", f"{stage}: query head {head} read K/V head {j} instead of K/V head "
                              f"{own}, its group's ({' or '.join(w for _, w in maps)}) (max diff {diff:.2g})",
                              {"read_kv_head": j, "kv_head": own, "maps": [n for n, _ in maps], "max_diff": diff},
                              0.95)]
    return []


# ---- K from one head, V from another ---------------------------------------------------------------

def neighbours(count: int, own: int) -> List[int]:
    """The heads (of `count`) a wrong offset into a buffer of heads reads instead of `own`: the next
    and the previous (a head index off by one), the first (a head stride of 0) and the last."""
    return [j for j in dict.fromkeys((own + 1, own - 1, 0, count - 1)) if 0 <= j < count and j != own]


def other_head_stage(stage: str, ctx: Suspect, other: int) -> Optional[np.ndarray]:
    """Query head `other`'s reference of `stage` from its inputs (an operand a program read from
    another head's buffer), None where that head's own tensors are not at hand (a per-head mask or
    bias file, a dropout keep-mask) or its slope is not known."""
    v = variant_of(ctx)
    if (ctx.inputs_of_head is None or PER_HEAD in (v.mask, v.bias) or v.dropout
            or (v.alibi and ctx.slope_of_head is None)):
        return None
    src = {**variant_tensors(ctx), **ctx.inputs_of_head(other)}
    slope = ctx.slope_of_head(other) if v.alibi else 0.0
    return reference_chain(src, ctx.scale, v.causal, [stage], variant=v, slope=slope)[stage]


def operand_head(stage, got, want, ctx, width) -> List[Diagnosis]:
    """A query head's stage computed with K of another K/V head and V of its own, or the reverse:
    one operand's offset into its buffer off by a head."""
    dims, head = ctx.dims, ctx.head
    if dims is None or head is None or STAGES[stage].kv or ctx.inputs_of_head is None or dims.total_kv_heads < 2:
        return []
    own = dims.kv_head_of(head)
    for j in neighbours(dims.total_kv_heads, own):
        other = _kv_inputs(ctx, j)
        for name, kept, replace in ((KEYS, VALUES, {KEYS: other[KEYS], KEYS_T: other[KEYS_T]}),
                                    (VALUES, KEYS, {VALUES: other[VALUES]})):
            for cand, w in alternatives(stage, ctx, width, replace=replace):
                diff = explains_closely(got, cand, want, w)
                if diff is not None:
                    what = "K/V head" if dims.kv_heads else "head"
                    return [Diagnosis("operand_head", f"{stage}: query head {head} read {name} of {what} {j} and "
                                      f"{kept} of its own, {what} {own} (the offset into {name} off by "
                                      f"{j - own:+d} heads) (max diff {diff:.2g})",
                                      {"operand": name, "read_head": j, "own_head": own, "max_diff": diff}, 0.93)]
    return []


# ---- a K/V head's gradient summed over its group ------------------------------------------------

def kv_group_sum(stage, got, want, ctx, width) -> List[Diagnosis]:
    """dK or dV of a K/V head: one query head's part only (not accumulated over the group: the
    first's, or the last's that overwrote the others), or the sum taken twice."""
    terms = ctx.group_terms
    if not terms or len(terms) < 2:
        return []
    heads = list(ctx.dims.query_heads_of(ctx.head)) if ctx.dims is not None else list(range(len(terms)))
    for i, term in sorted(enumerate(terms), key=lambda t: (t[0] not in (0, len(terms) - 1), -t[0])):
        diff = explains_closely(got, np.asarray(term, np.float64), want, width)
        if diff is not None:
            which = ("the last of its group: each query head's part overwrote the previous one's"
                     if i == len(terms) - 1 else "the first of its group" if i == 0 else f"number {i} of its group")
            return [Diagnosis("kv_group_not_summed", f"{stage} K/V head {ctx.head} holds query head {heads[i]}'s "
                              f"part only ({which}), not the sum over its {len(terms)} query heads "
                              f"{heads[0]}..{heads[-1]} (max diff {diff:.2g})",
                              {"query_head": heads[i], "position": i, "group": heads, "max_diff": diff}, 0.95)]
    diff = explains_closely(got, 2.0 * want, want, 2.0 * width)
    if diff is not None:
        return [Diagnosis("kv_group_summed_twice", f"{stage} K/V head {ctx.head} holds twice the sum over its "
                          f"{len(terms)} query heads {heads[0]}..{heads[-1]} (accumulated twice, or onto a buffer "
                          f"that already held it) (max diff {diff:.2g})", {"group": heads, "max_diff": diff}, 0.95)]
    return []


def group_rebuildable(ctx: Suspect) -> bool:
    """Whether a K/V head's summed stage can be rebuilt from its query heads' inputs (group_sum):
    not where each query head has tensors of its own (a slope, mask or bias files, a keep-mask)."""
    dims, v = ctx.dims, variant_of(ctx)
    return bool(ctx.group_terms and ctx.inputs_of_head is not None and dims is not None and dims.group_size >= 2
                and not (v.alibi or v.bias != NONE or v.mask != NONE or v.dropout))


def group_sum(stage: str, ctx: Suspect, heads, variant: Variant,
              masked: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
    """K/V head ctx.head's summed stage (dK, dV) as the sum over query heads `heads` of their
    references against its K and V (each head's Q and dO), under `variant`, or under the whole mask
    `masked` (True hides; the stage's with_mask, its upstream stages from the inputs under the same
    mask: a program that masked every query head so); None where a head's dO is not at hand or the
    stage has no such recomputation."""
    own = _kv_inputs(ctx, ctx.head)
    total = 0.0
    for h in heads:
        x = ctx.inputs_of_head(h)
        if x.get(GRAD_OUTPUT) is None:
            return None
        src = {QUERIES: x[QUERIES], KEYS: own[KEYS], VALUES: own[VALUES], GRAD_OUTPUT: x[GRAD_OUTPUT]}
        if masked is None:
            total = total + reference_chain(src, ctx.scale, variant.causal, [stage], variant=variant)[stage]
            continue
        upstream = [n for n in STAGES[stage].inputs if n not in src]
        if SPECS[stage].with_mask is None or any(SPECS[n].from_inputs is None for n in upstream):
            return None
        for n in upstream:
            src[n] = SPECS[n].from_inputs(src, ctx.scale, masked, variant=variant)
        total = total + SPECS[stage].with_mask(src, ctx.scale, masked, variant=variant)
    return np.asarray(total, np.float64)


def kv_group_map(stage, got, want, ctx, width) -> List[Diagnosis]:
    """dK or dV of a K/V head under the map h % Hk: the sum of the parts of the query heads that map
    sends to it (each against this K/V head's K and V), not of its group's (h // (H/Hk))."""
    if not group_rebuildable(ctx):
        return []
    dims, kv_head = ctx.dims, ctx.head
    b, j = divmod(kv_head, dims.kv)
    readers = [b * dims.heads + h for h in range(dims.heads) if h % dims.kv == j]
    group = list(dims.query_heads_of(kv_head))
    if readers == group:
        return []
    cand = group_sum(stage, ctx, readers, variant_of(ctx))
    diff = None if cand is None else explains_closely(got, cand, want, width)
    if diff is None:
        return []
    return [Diagnosis("kv_head_map", f"{stage} K/V head {kv_head} holds the sum over query heads "
                      f"{', '.join(map(str, readers))}, those the map h % Hk (interleaved) sends to it, instead of "
                      f"over its group {group[0]}..{group[-1]} (h // (H/Hk) = h // {dims.group_size}) "
                      f"(max diff {diff:.2g})",
                      {"kv_head": kv_head, "read_by": readers, "group": group, "maps": ["modulo"], "max_diff": diff},
                      0.95)]


def heads(stage, got, want, ctx, width) -> List[Diagnosis]:
    """Every head mix-up: another K/V head read, another head's result, a group not summed. The K/V
    head read first: where a query's own rows do not matter (a sequence of one key: its output is
    that key's value row) it is also another head's result, and the wrong map is the cause."""
    return (kv_head_map(stage, got, want, ctx, width) or head_permuted(stage, got, want, ctx, width)
            or kv_group_sum(stage, got, want, ctx, width) or kv_group_map(stage, got, want, ctx, width)
            or operand_head(stage, got, want, ctx, width))
