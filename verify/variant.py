"""The attention variants a case may ask for, on the Python side: grouped K/V heads, the causal
mask's alignment, a sliding window, a softcap, ALiBi, mask and bias files, dropout.

`cuda_src/variant.h` is its C++ twin; docs/contract.md describes both. Every module that builds a
mask, modifies scores or maps a query head to its K/V head goes through the functions here, so the
reference, the error model, the diagnoses and the generator agree on one definition.

Conventions (those of flash-attn and PyTorch, so a program written for them checks untranslated):
* GQA/MQA: H query heads share Hk K/V heads (H a multiple of Hk); query head h reads K/V head
  h // (H/Hk) (flash-attn, SDPA's enable_gqa). dK and dV are summed over the group. Hk is a
  dimension (verify/stages.py Dims.kv_heads, manifest key `kv_heads`), not part of Variant.
* The diagonal of query row i is key i + offset: offset 0 when aligned top-left (PyTorch's
  is_causal), M − N when aligned bottom-right (flash-attn ≥ 2.1).
* Key j is visible to row i when diag(i) − left ≤ j ≤ diag(i) + right, where a bound of −1 is
  unbounded (flash-attn's window_size); causal makes right 0.
* Scores: S = scale·Q·Kᵀ; S ← C·tanh(S/C) (softcap C > 0); S ← S − slope_h·|diag(i) − j| (ALiBi,
  flash-attn's sign: the bias falls with the distance from the diagonal); S ← S + bias (a bias
  file); S = −inf where not visible or where a boolean mask file holds 0 (PyTorch attn_mask: True
  keeps). A row that sees no key has weights 0, output 0 and lse −inf.
* Dropout p: the program writes its keep-mask Z (1 kept, 0 dropped) as the stage dropout_mask;
  the output is (P∘Z)/(1 − p)·V.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import numpy as np

TOP_LEFT, BOTTOM_RIGHT = "top-left", "bottom-right"
ALIGNMENTS = (TOP_LEFT, BOTTOM_RIGHT)
UNBOUNDED = -1
# The widest window side (cuda_src/io/variant_manifest.h kMaxWindow): a 32-bit count of keys, as flash-attn's
# window_size; wider sees what an unbounded side sees, and diag ± bound stays inside 64 bits.
MAX_WINDOW = 2**31 - 1
# How a mask or bias file covers the heads: one matrix per query head, or one for all of them.
PER_HEAD, BROADCAST = "per-head", "broadcast"
TENSOR_COVERAGE = (PER_HEAD, BROADCAST)

# Manifest keys of the variants (input manifest.toml and run.toml), with their types and the
# value a case without the key has. cuda_src/variant.h's kVariantKeys is the C++ twin.
VARIANT_KEYS = {
    "align": str,            # top-left | bottom-right
    "window_left": int,      # -1: unbounded
    "window_right": int,
    "softcap": float,        # 0: none
    "alibi": bool,
    "bias": str,             # none | per-head | broadcast (input files bias_head_{i} / bias)
    "mask": str,             # none | per-head | broadcast (input files mask_head_{i} / mask)
    "dropout": float,        # 0: none
    "dropout_seed": int,
}
NONE = "none"
WINDOW_KEYS = ("window_left", "window_right")  # the manifest keys of Variant.window's two sides


@dataclass(frozen=True)
class Variant:
    """One case's variant of attention (everything but the dimensions, scale and dO). The default
    is textbook multi-head attention; `causal` is the mask's bool, as before variants existed."""
    causal: bool = False
    align: str = TOP_LEFT
    window: Tuple[int, int] = (UNBOUNDED, UNBOUNDED)
    softcap: float = 0.0
    alibi: bool = False
    bias: str = NONE
    mask: str = NONE
    dropout: float = 0.0
    dropout_seed: int = 0

    def __post_init__(self):
        problem = validate(self)
        if problem:
            raise ValueError(problem)

    # -- the mask ------------------------------------------------------------------------------
    @property
    def left(self) -> int:
        return self.window[0]

    @property
    def right(self) -> int:
        """The right bound of the window: 0 when causal."""
        return 0 if self.causal else self.window[1]

    @property
    def structural(self) -> bool:
        """Whether the mask built from the causal flag and the window hides any key at some size."""
        return self.causal or self.window != (UNBOUNDED, UNBOUNDED)

    def offset(self, n: int, m: int) -> int:
        """Key index of query row 0's diagonal."""
        return m - n if self.align == BOTTOM_RIGHT else 0

    def visible(self, n: int, m: int, rows: slice = slice(None), cols: slice = slice(None)) -> np.ndarray:
        """True where query row i may see key j (the causal flag and the window; not a mask file),
        for rows × cols of the n×m score matrix."""
        i = np.arange(n)[rows][:, None]
        j = np.arange(m)[cols][None, :]
        diag = i + self.offset(n, m)
        ok = np.ones((i.shape[0], j.shape[1]), dtype=bool)
        if self.left != UNBOUNDED:
            ok &= j >= diag - self.left
        if self.right != UNBOUNDED:
            ok &= j <= diag + self.right
        return ok

    def key_range(self, n: int, m: int, row: int) -> Tuple[int, int]:
        """[first, last + 1) of the keys row `row` may see (empty when first >= last + 1)."""
        diag = row + self.offset(n, m)
        first = 0 if self.left == UNBOUNDED else max(0, diag - self.left)
        end = m if self.right == UNBOUNDED else min(m, diag + self.right + 1)
        return first, max(first, end)

    # -- the scores -------------------------------------------------------------------------------
    @property
    def modifies_scores(self) -> bool:
        return self.softcap > 0 or self.alibi or self.bias != NONE

    def with_(self, **changes) -> "Variant":
        return replace(self, **changes)


# The rules of the variant's values, each the words after "key = value: " (None: the value keeps
# it). cuda_src/io/variant_manifest.h's window_bound_problem, softcap_problem, dropout_problem,
# dropout_seed_problem and causal_window_problem are their C++ twins, in the same words; the
# binary holds the softcap and dropout as float32, so a value is judged as that float32 too.

def window_bound_problem(bound) -> Optional[str]:
    ok = isinstance(bound, (int, np.integer)) and UNBOUNDED <= bound <= MAX_WINDOW
    return None if ok else f"must be -1 (unbounded) or a number of keys from 0 to {MAX_WINDOW}"


def _float32(x: float) -> float:
    """x as the binary holds it: rounded to float32 (inf beyond its range)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


# float32's smallest normal number: a softcap below it is 0 or flushed to 0 in the kernels (no cap).
FLOAT32_MIN_NORMAL = float(np.finfo(np.float32).tiny)
# float32's smallest positive number: a dropout below it rounds to 0 (no dropout, no keep-mask).
FLOAT32_MIN_POSITIVE = float(np.finfo(np.float32).smallest_subnormal)


def softcap_problem(cap: float) -> Optional[str]:
    if not (math.isfinite(cap) and cap >= 0 and math.isfinite(_float32(cap))):
        return "must be a finite number > 0 (0: none)"
    if 0 < cap and abs(_float32(cap)) < FLOAT32_MIN_NORMAL:
        return "must be 0 (none) or a positive float32 (at least 1.18e-38)"
    return None


def dropout_problem(p: float) -> Optional[str]:
    if not (math.isfinite(p) and 0 <= p < 1):
        return "must be a probability in [0, 1)"
    # 0.99999999999 is < 1 but rounds to 1 in float32, where every entry would be dropped.
    if _float32(p) >= 1:
        return "must be a probability in [0, 1), below 1 as a float32 (it rounds to 1)"
    if 0 < p < FLOAT32_MIN_POSITIVE and _float32(p) == 0:
        return "must be 0 (none) or a positive float32 (at least 1.4e-45)"
    return None


def dropout_seed_problem(seed) -> Optional[str]:
    ok = isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and seed >= 0
    return None if ok else "must be an integer >= 0"


def causal_window_problem(right) -> Optional[str]:
    """Why a causal mask cannot have this right bound (it sees no key right of the diagonal)."""
    return None if right in (UNBOUNDED, 0) else "a causal mask sees no key right of the diagonal (use 0 or -1)"


def value_text(x) -> str:
    """A value as the messages show it, the binary's way (its value_text and toml_float): a string
    quoted, a float in the fewest digits from 9 that read back to it, '.0' added to a whole one."""
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, float):
        if not math.isfinite(x):
            return "nan" if math.isnan(x) else "inf" if x > 0 else "-inf"
        text = next((t for t in (f"{x:.{p}g}" for p in range(9, 17)) if float(t) == x), f"{x:.17g}")
        return text if any(c in text for c in ".eE") else text + ".0"
    return repr(x)


def with_causal(variant: Optional[Variant], causal) -> Variant:
    """The variant an object that also carries the older `causal` flag holds: the variant, causal
    when either says so (an InputCase or RunInfo built with causal=True and no variant)."""
    if variant is None:
        return Variant(causal=bool(causal))
    return variant.with_(causal=True) if causal and not variant.causal else variant


def validate(v: Variant) -> Optional[str]:
    """Why `v` is not a variant, or None: one line, "key = value: rule", the key as a manifest
    writes it, in the binary's words."""
    if v.align not in ALIGNMENTS:
        return f"align = {value_text(v.align)}: must be {' or '.join(ALIGNMENTS)}"
    for key, bound in zip(WINDOW_KEYS, v.window):
        why = window_bound_problem(bound)
        if why:
            return f"{key} = {value_text(bound)}: {why}"
    why = causal_window_problem(v.window[1]) if v.causal else None
    if why:
        return f"{WINDOW_KEYS[1]} = {value_text(v.window[1])}: {why}"
    why = softcap_problem(v.softcap)
    if why:
        return f"softcap = {value_text(v.softcap)}: {why}"
    for name in ("bias", "mask"):
        if getattr(v, name) not in (NONE,) + TENSOR_COVERAGE:
            return f"{name} = {value_text(getattr(v, name))}: must be none, per-head or broadcast"
    for key, rule in (("dropout", dropout_problem), ("dropout_seed", dropout_seed_problem)):
        why = rule(getattr(v, key))
        if why:
            return f"{key} = {value_text(getattr(v, key))}: {why}"
    return None


def softcap(s: np.ndarray, cap: float) -> np.ndarray:
    """C·tanh(S/C), in S's type (−inf stays −inf)."""
    return cap * np.tanh(s / cap) if cap > 0 else s


def alibi_slopes(heads: int) -> np.ndarray:
    """The standard ALiBi slopes of `heads` heads (Press et al.; flash-attn's tests and most
    models): 2^(−8(h+1)/n) for n = the largest power of two ≤ heads, then, for the heads beyond
    it, every other slope of 2n heads."""
    def powers(n: int) -> list:
        start = 2.0 ** (-8.0 / n)
        return [start ** (h + 1) for h in range(n)]
    n = 2 ** int(math.floor(math.log2(heads)))
    slopes = powers(n)
    if n < heads:
        slopes += powers(2 * n)[0::2][: heads - n]
    return np.asarray(slopes, dtype=np.float64)


def alibi_bias(slope: float, n: int, m: int, rows: slice = slice(None), cols: slice = slice(None),
               align: str = BOTTOM_RIGHT) -> np.ndarray:
    """−slope·|diag(i) − j| over rows × cols: flash-attn's ALiBi (measured from the bottom-right
    diagonal in flash-attn; from the case's alignment here, which is flash-attn's when the case
    is aligned bottom-right or N = M)."""
    i = np.arange(n)[rows][:, None] + (m - n if align == BOTTOM_RIGHT else 0)
    j = np.arange(m)[cols][None, :]
    return -float(slope) * np.abs(i - j).astype(np.float64)


def modified_scores(scaled: np.ndarray, v: Variant, slope: float = 0.0, bias: Optional[np.ndarray] = None,
                    rows: slice = slice(None), cols: slice = slice(None), n: Optional[int] = None,
                    m: Optional[int] = None) -> np.ndarray:
    """scale·QK (rows × cols of an n×m head; the whole head by default) after the softcap, ALiBi
    and the bias, unmasked. float64 in, float64 out."""
    n = scaled.shape[0] if n is None else n
    m = scaled.shape[1] if m is None else m
    s = softcap(scaled, v.softcap)
    if v.alibi:
        s = s + alibi_bias(slope, n, m, rows, cols, v.align)
    if bias is not None:
        s = s + bias
    return s


def hidden(v: Variant, n: int, m: int, mask: Optional[np.ndarray] = None, rows: slice = slice(None),
           cols: slice = slice(None)) -> np.ndarray:
    """True where masked: not visible under the causal flag and window, or 0 in the mask file
    (`mask`: the head's rows × cols of it, nonzero = keep)."""
    out = ~v.visible(n, m, rows, cols)
    if mask is not None:
        out |= mask == 0
    return out


# How rarely a correct run's dropout keep rate may fail its test: once in a million runs.
DROPOUT_FALSE_ALARM = 1e-6


def dropout_keep_band(total: int, false_alarm: float = DROPOUT_FALSE_ALARM) -> float:
    """The half-width t of the keep rates `total` independent draws of a correct run stay within
    about 1 − p: Hoeffding's inequality bounds the chance of a rate ≥ t from 1 − p by
    2·exp(−2·total·t²), and t makes that `false_alarm`."""
    return math.sqrt(math.log(2.0 / false_alarm) / (2.0 * total)) if total else math.inf


def dropout_keep_rates(p: float) -> Tuple[float, ...]:
    """The keep rates a correct program at dropout p may draw with: 1 − p, and that of flash-attn's
    8-bit threshold (it keeps an entry when a random byte is ≤ ⌊255·(1 − p)⌋, p_dropout_in_uint8_t,
    so it keeps (⌊255·(1 − p)⌋ + 1)/256 of them: 0.8984 at p = 0.1)."""
    exact = 1.0 - p
    byte = (math.floor(float(np.float32(1.0 - np.float32(p))) * 255.0) + 1) / 256.0
    return (exact,) if byte == exact else (exact, byte)


def dropout_keep_tolerance(kept: int, total: int, p: float, false_alarm: float = DROPOUT_FALSE_ALARM) -> Optional[str]:
    """Whether `kept` of `total` independent draws is a plausible keep count for dropout p: a rate
    within the band of 1 − p or of flash-attn's 8-bit threshold's rate (dropout_keep_rates). None if
    so, else a one-line reason naming both (dropout_keep_band: a correct run fails at most once in
    1/false_alarm)."""
    if total == 0:
        return None
    t = dropout_keep_band(total, false_alarm)
    rate = kept / total
    rates = dropout_keep_rates(p)
    if any(abs(rate - r) <= t for r in rates):
        return None
    named = f"{rates[0]:.4%} ± {t:.4%}"
    if len(rates) > 1:
        named += f" (or {rates[1]:.4%} ± {t:.4%} with an 8-bit threshold, flash-attn's)"
    return (f"kept {kept} of {total} ({rate:.4%}); dropout {p} keeps {named} "
            f"(a correct run is outside that less than once in {1 / false_alarm:.0f})")
