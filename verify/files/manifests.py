"""Manifests: the flat `key = value` TOML subset both readers take (input cases' manifest.toml,
run.toml), their types, and the limits on a case's dimensions (cuda_src/io/manifest.cpp is the
binary's twin)."""
from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path
from typing import Optional

import numpy as np

from ..sequences import NEW_KEYS_KEY, PAGE_SIZE_KEY, SEQUENCES_KEY
from ..stages import DIM_KEYS, KV_HEADS_KEY, MAX_DIM, MAX_ELEMENTS, MAX_HEAD_DIM, MAX_HEADS, Dims
from ..text import plural, printable
from ..variant import UNBOUNDED, VARIANT_KEYS, WINDOW_KEYS, Variant
from .kinds import CaseError
from .matrix_io import atomic_write_bytes, read_bytes

# ----------------------------------------------------------------------------------------------
# Manifests: flat `key = value` TOML.

CAUSAL_KEY = "causal"
INPUT_KEYS = {**{k: int for k in DIM_KEYS}, KV_HEADS_KEY: int, SEQUENCES_KEY: int, PAGE_SIZE_KEY: int, NEW_KEYS_KEY: int, CAUSAL_KEY: bool,
              **VARIANT_KEYS, "scale": float, "format": str, "seed": int, "distribution": str, "generator": str,
              "backward": bool}
_TYPE_WORDS = {int: "an integer", bool: "true or false", float: "a number", str: "a quoted string"}
INT64 = 2**63


def check_types(values: dict, types: dict, where: str) -> None:
    """Each known key has its type (an int is a number too, a bool is not an int). Integers are
    64-bit, as TOML says and the binary reads them: a larger one is an error, not a float."""
    for key, want in types.items():
        if key not in values:
            continue
        v = values[key]
        is_int = isinstance(v, int) and not isinstance(v, bool)
        if is_int and want in (int, float) and not -INT64 <= v < INT64:
            raise CaseError(f"{where}: '{key}' = {v}: integer is out of the 64-bit range; "
                            "HINT: write a float (e.g. 1e20) where a number is meant")
        ok = (isinstance(v, bool) if want is bool else
              is_int or isinstance(v, float) if want is float else
              is_int if want is int else
              isinstance(v, want))
        if not ok:
            raise CaseError(f"{where}: '{key}' must be {_TYPE_WORDS[want]} (got {printable(repr(v))})")


def check_scale(scale, where: str) -> float:
    """The scale the binary can use: finite and non-zero in float32."""
    s32 = np.float32(scale) if np.isfinite(scale) and abs(scale) < 3.5e38 else np.float32(np.inf)
    if not np.isfinite(s32) or s32 == 0:
        raise CaseError(f"{where}: scale = {scale!r}: must be finite and non-zero in float32")
    return float(scale)


# A value that opens a multi-line string: the binary reads one `key = value` per line, so both
# readers refuse these (tomllib alone would accept them).
_MULTILINE_STRING = re.compile(rb"^[ \t]*(?:[A-Za-z0-9_-]+|\"[^\"\n]*\"|'[^'\n]*')[ \t]*=[ \t]*(\"\"\"|''')",
                               re.MULTILINE)


def _line_col(data: bytes, offset: int) -> str:
    line = data.count(b"\n", 0, offset) + 1
    col = offset - (data.rfind(b"\n", 0, offset) + 1) + 1
    return f"{line}:{col}"


def read_toml(path: Path, what: str = "manifest") -> dict:
    """A TOML file of the manifests' subset; `what` names it in errors (a names file is no manifest)."""
    data = read_bytes(path)
    # ASCII without control characters (tabs and line ends aside, a CR only before a line feed),
    # as the binary's reader.
    bad = re.search(rb"[^\t\n\r\x20-\x7e]|\r(?!\n)", data)
    if bad:
        raise CaseError(f"{path}:{_line_col(data, bad.start())}: byte 0x{data[bad.start()]:02X} in the "
                        f"{what} (ASCII text only)")
    multi = _MULTILINE_STRING.search(data)
    if multi:
        raise CaseError(f"{path}:{_line_col(data, multi.start(1))}: multi-line strings are not supported")
    try:
        return tomllib.loads(data.decode("ascii"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise CaseError(f"{path}: not a valid {what} ({exc})") from None


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("inf" if v > 0 else "-inf") if not math.isnan(v) else "nan"
    if isinstance(v, int):
        return str(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_toml(path: Path, values: dict, comment: str, through_links: bool = True) -> None:
    """through_links: as atomic_write_bytes (False for a file attnstep names inside a folder: a link
    there is replaced, never the file it points to, which may lie outside the folder)."""
    body = f"# {comment}\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items())
    atomic_write_bytes(path, body.encode("utf-8"), through_links)


def validate_dims(values: dict, where: str) -> Dims:
    for key in DIM_KEYS:
        v = values.get(key)
        if not isinstance(v, int) or isinstance(v, bool):
            raise CaseError(f"{where}: '{key}' must be an integer (got {printable(repr(v))})")
        if not 1 <= v <= MAX_DIM:
            raise CaseError(f"{where}: '{key}' = {v}: dimensions must be in 1..{MAX_DIM}")
    for key in ("d_k", "d_v"):
        if values[key] > MAX_HEAD_DIM:
            raise CaseError(f"{where}: '{key}' = {values[key]}: at most {MAX_HEAD_DIM} is supported")
    dims = Dims(*(values[k] for k in DIM_KEYS), kv_heads=_kv_heads(values, where))
    check_case_limits(dims, where)
    return dims


# The words of kv_heads' rule and its hint; cuda_src/io/variant_manifest.cpp kv_heads_problem and
# apply_kv_heads are the twins.
KV_HEADS_HINT = "use a divisor of heads: 1 (one K/V head for all), ..., heads (one each)"


def kv_heads_problem(kv: int, heads: int) -> Optional[str]:
    """Why `kv` K/V heads cannot serve `heads` query heads (1..heads, a divisor), or None."""
    if 1 <= kv <= heads and heads % kv == 0:
        return None
    return f"must be 1..heads and divide heads = {heads} (each K/V head serves heads / kv_heads query heads)"


def _kv_heads(values: dict, where: str) -> int:
    """Dims.kv_heads from the manifest key: 1..heads and a divisor of heads (0 is refused, as the
    binary refuses it); absent or equal to heads is one K/V head per query head, Dims' 0."""
    kv = values.get(KV_HEADS_KEY)
    if kv is None:
        return 0
    if not isinstance(kv, int) or isinstance(kv, bool):
        raise CaseError(f"{where}: '{KV_HEADS_KEY}' must be an integer (got {printable(repr(kv))})")
    why = kv_heads_problem(kv, values["heads"])
    if why:
        raise CaseError(f"{where}: {KV_HEADS_KEY} = {kv}: {why}; HINT: {KV_HEADS_HINT}")
    return 0 if kv == values["heads"] else kv


def check_case_limits(dims: Dims, where: str, backward: bool = False, dropout: bool = False) -> None:
    """Dimensions each in range can still make a case too large (verify/stages.py MAX_HEADS,
    MAX_ELEMENTS; the binary's case_limit_violation says the same): the stages of the K/V heads
    count once per K/V head, the backward stages only with dO (`backward`), the keep-mask only with
    dropout (`dropout`)."""
    heads = dims.total_heads
    hint = "HINT: split the work into smaller cases (fewer heads or shorter sequences)"
    if heads > MAX_HEADS:
        raise CaseError(f"{where}: the case is too large: batch x heads = {plural(heads, 'head')}; at most {MAX_HEADS}; {hint}")
    if dims.case_elements(backward, dropout) > MAX_ELEMENTS:
        raise CaseError(f"{where}: the case is too large: {_elements_in_words(dims, backward, dropout)}; "
                        f"at most {MAX_ELEMENTS} elements in all; {hint}")


def _elements_in_words(dims: Dims, backward: bool, dropout: bool) -> str:
    """'16 heads of N stage elements each', or for grouped K/V heads the query heads' and the K/V
    heads' counts apart."""
    per_head, per_kv_head = (dims.elements_per_head(backward, dropout, kv=kv) for kv in (False, True))
    if dims.total_kv_heads == dims.total_heads:
        return f"{plural(dims.total_heads, 'head')} of {plural(per_head + per_kv_head, 'stage element')} each"
    return (f"{plural(dims.total_heads, 'query head')} of {plural(per_head, 'stage element')} each and "
            f"{plural(dims.total_kv_heads, 'K/V head')} of {per_kv_head} each")


# ----------------------------------------------------------------------------------------------
# The variant keys (verify/variant.py VARIANT_KEYS, and `causal`) of a manifest, as Variant fields.

# The Variant field each manifest key sets (the two window keys set one field, `window`).
_KEY_FIELDS = {CAUSAL_KEY: "causal", **{k: "window" if k in WINDOW_KEYS else k for k in VARIANT_KEYS}}


def variant_fields(values: dict) -> dict:
    """The Variant fields that the manifest `values` says (its keys present), by field name; a
    window key alone leaves the other side unbounded."""
    fields = {_KEY_FIELDS[k]: values[k] for k in _KEY_FIELDS if k in values and k not in WINDOW_KEYS}
    if any(k in values for k in WINDOW_KEYS):
        fields["window"] = tuple(values.get(k, UNBOUNDED) for k in WINDOW_KEYS)
    return fields


def variant_keys(v: Variant) -> dict:
    """The manifest keys of `v`, every one (run.toml's effective values; the generator writes the
    ones that differ from the default)."""
    out = {CAUSAL_KEY: v.causal, **{k: getattr(v, _KEY_FIELDS[k]) for k in VARIANT_KEYS if k not in WINDOW_KEYS}}
    out.update(zip(WINDOW_KEYS, v.window))
    return {k: out[k] for k in _KEY_FIELDS}


def build_variant(fields: dict, where) -> Variant:
    """Variant(**fields), an invalid one a CaseError in one line: `where(field)` (or the string
    `where`) says where the field came from, then verify.variant.validate's words ("key = value:
    rule", as the binary says them)."""
    at = where if callable(where) else (lambda _field: where)
    for field, value in fields.items():  # each on its own: the error says where the one at fault came from
        try:
            Variant(**{field: value})
        except ValueError as exc:
            raise CaseError(f"{at(field)}: {exc}") from None
    try:
        return Variant(**fields)
    except ValueError as exc:  # a rule of two fields: causal and the window's right side
        raise CaseError(f"{at('window')}: {exc} (causal from {at('causal')})") from None
