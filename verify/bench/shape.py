"""One problem `attnstep bench` times: the shape, and the variant the binary's `main --bench` takes
with it (grouped K/V heads, the causal mask's alignment, a sliding window, a softcap, ALiBi), with
its id in the table and its work in FLOP.

The work counts the score entries the mask leaves visible, exactly, as the binary does
(cuda_src/bench/bench_options.h): 4·d per visible entry of each query head (4·B·H·N·M·d without a
mask, N(N+1)/2 entries instead of N² under the causal mask of a square head); grouped K/V heads
change nothing (every query head computes).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Tuple

import numpy as np

from ..variant import ALIGNMENTS, TOP_LEFT, UNBOUNDED, Variant

# The FlashAttention convention: a backward pass counts 2.5 times the forward's FLOPs.
BACKWARD_FLOP_FACTOR = 2.5
NO_WINDOW = (UNBOUNDED, UNBOUNDED)


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    seq_q: int
    seq_k: int
    d: int
    causal: bool
    kv_heads: int = 0                      # K/V heads per batch element; 0: one per query head
    align: str = TOP_LEFT
    window: Tuple[int, int] = NO_WINDOW    # (left, right), -1 unbounded
    softcap: float = 0.0
    alibi: bool = False

    def __post_init__(self):
        # One spelling per problem: H K/V heads is no grouping (0), a window is a tuple.
        object.__setattr__(self, "kv_heads", 0 if self.kv_heads == self.heads else self.kv_heads)
        object.__setattr__(self, "window", tuple(self.window))
        self.variant  # noqa: B018 (validates the mask and the softcap)
        if self.kv_heads and (self.kv_heads < 0 or self.heads % self.kv_heads):
            raise ValueError(f"kv_heads = {self.kv_heads}: must divide heads = {self.heads}")

    @property
    def variant(self) -> Variant:
        """The variant's mask and score modifications (verify/variant.py's definition)."""
        return Variant(causal=self.causal, align=self.align, window=self.window, softcap=self.softcap,
                       alibi=self.alibi)

    @property
    def grouped(self) -> bool:
        """Whether the K/V heads are fewer than the query heads (GQA/MQA)."""
        return 0 < self.kv_heads < self.heads

    @property
    def plain(self) -> bool:
        """No variant beyond the top-left causal mask: what PyTorch's SDPA is timed on."""
        return self.base == self

    @property
    def base(self) -> "Shape":
        """The same shape without the variant (the causal flag kept)."""
        return Shape(self.batch, self.heads, self.seq_q, self.seq_k, self.d, self.causal)

    @property
    def id(self) -> str:
        return (f"B{self.batch}-H{self.heads}-N{self.seq_q}-M{self.seq_k}-d{self.d}"
                + "".join(f"-{token}" for token in variant_tokens(self))
                + ("-causal" if self.causal else ""))

    @property
    def visible_entries(self) -> int:
        """The score entries of one head the mask leaves visible."""
        return visible_entries(self.seq_q, self.seq_k, self.variant)

    @property
    def flash_flop(self) -> float:
        """Forward FLOP: 4·d per visible score entry of each query head."""
        return 4.0 * self.batch * self.heads * self.d * self.visible_entries

    @property
    def backward_flop(self) -> float:
        """Backward FLOP: 2.5x the forward's."""
        return BACKWARD_FLOP_FACTOR * self.flash_flop


def visible_entries(n: int, m: int, variant: Variant) -> int:
    """Σ over rows of the keys each sees (variant.key_range's), vectorised: exact at any size."""
    diag = np.arange(n, dtype=np.int64) + variant.offset(n, m)
    first = np.zeros(n, dtype=np.int64) if variant.left == UNBOUNDED else np.maximum(0, diag - variant.left)
    end = np.full(n, m, dtype=np.int64) if variant.right == UNBOUNDED else np.minimum(m, diag + variant.right + 1)
    return int(np.maximum(0, end - first).sum())


def variant_tokens(shape: Shape) -> List[str]:
    """The id's words for the variant, in a fixed order ("kv8", "bottom-right", "window1024,0",
    "softcap50", "alibi"); none for a plain shape."""
    tokens = []
    if shape.grouped:
        tokens.append(f"kv{shape.kv_heads}")
    if shape.align != TOP_LEFT:
        tokens.append(shape.align)
    if shape.window != NO_WINDOW:
        tokens.append("window{},{}".format(*shape.window))
    if shape.softcap:
        tokens.append(f"softcap{shape.softcap:g}")
    if shape.alibi:
        tokens.append("alibi")
    return tokens


_ID = re.compile(r"B(\d+)-H(\d+)-N(\d+)-M(\d+)-d(\d+)(.*)")
_TOKENS = re.compile(r"-(?:kv(?P<kv>\d+)|(?P<align>" + "|".join(map(re.escape, ALIGNMENTS)) + r")"
                     r"|window(?P<left>-?\d+),(?P<right>-?\d+)|softcap(?P<cap>\d+(?:\.\d+)?(?:e[+-]\d+)?)"
                     r"|(?P<alibi>alibi)|(?P<causal>causal))")


def parse_shape_id(shape_id: str) -> Shape:
    """Inverse of Shape.id; raises ValueError on a malformed id."""
    head = _ID.fullmatch(shape_id)
    if not head:
        raise ValueError(f"'{shape_id}' is not a shape id (B#-H#-N#-M#-d#[-variant][-causal])")
    fields = dict(kv_heads=0, align=TOP_LEFT, window=NO_WINDOW, softcap=0.0, alibi=False, causal=False)
    rest, pos = head.group(6), 0
    for token in _TOKENS.finditer(rest):
        if token.start() != pos:
            break
        pos = token.end()
        g = token.groupdict()
        if g["kv"]:
            fields["kv_heads"] = int(g["kv"])
        elif g["align"]:
            fields["align"] = g["align"]
        elif g["left"] is not None:
            fields["window"] = (int(g["left"]), int(g["right"]))
        elif g["cap"] is not None:
            fields["softcap"] = float(g["cap"])
        else:
            fields["alibi" if g["alibi"] else "causal"] = True
    if pos != len(rest):
        raise ValueError(f"'{shape_id}': unknown variant '{rest[pos:]}'")
    b, h, n, m, d = (int(x) for x in head.groups()[:5])
    causal = fields.pop("causal")
    return Shape(b, h, n, m, d, causal, **fields)


def shape_of_binary(binary: dict) -> Shape:
    """The Shape of a `main --bench --json` document: its shape, and its variant when it has one
    (a run of a binary without variants has none)."""
    s, v = binary["shape"], binary.get("variant") or {}
    heads = s["heads"]
    kv = int(v.get("kv_heads", heads))
    return Shape(s["batch"], heads, s["seq_q"], s["seq_k"], s["d"], bool(s["causal"]),
                 kv_heads=kv, align=v.get("align", TOP_LEFT),
                 window=(int(v.get("window_left", UNBOUNDED)), int(v.get("window_right", UNBOUNDED))),
                 softcap=float(v.get("softcap", 0.0)), alibi=bool(v.get("alibi", False)))
