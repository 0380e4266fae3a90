"""Case folders on disk: strict matrix reading/writing (text and .npy), manifests, layout.

Every user error is a CaseError whose message is one line naming the file (and line and column
where they apply); the CLI turns it into exit status 2.
"""
from __future__ import annotations

import ast
import io
import math
import os
import re
import stat
import tomllib
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from .stages import (DIM_KEYS, FORMATS, INPUT_MANIFEST, INPUT_NAMES, MAX_DIM, MAX_ELEMENTS, MAX_HEAD_DIM,
                     MAX_HEADS, NPY_MAX_HEADER_BYTES, STAGES, TEXT_BYTES_PER_VALUE,
                     TEXT_SLACK_BYTES, Dims, parse_stage_file, stage_file)


class CaseError(Exception):
    """Bad input: the message is one line that names what is wrong and where."""


# ----------------------------------------------------------------------------------------------
# Atomic writes: a file appears complete or not at all.

_FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str:
    """What an st_mode that is not a regular file is, in words."""
    return next((word for test, word in _FILE_KINDS if test(mode)), "a special file")


def output_file_target(path: Path) -> Path:
    """The regular file that writing `path` creates or replaces: `path` itself, or the file a
    symbolic link there points to (the link stays). Anything else there (a folder, a device, a
    FIFO, a socket) is refused rather than replaced or written into, as is a missing folder."""
    path = Path(path)
    try:
        st: Optional[os.stat_result] = os.stat(path)  # through symbolic links
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise CaseError(f"{path}: cannot write: {exc.strerror or exc}") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise CaseError(f"{path}: is {file_kind(st.st_mode)}, not a regular file; refusing to write over it")
    target = Path(os.path.realpath(path))
    try:
        same = st is None or os.path.samestat(st, os.stat(target))
    except OSError:
        same = False
    if not same:  # e.g. a link into /proc naming an open file: no name to replace it by
        raise CaseError(f"{path}: links to {target}, which is not the same file; refusing to write over it")
    if not target.parent.is_dir():
        raise CaseError(f"{path}: cannot write: folder {target.parent} does not exist")
    return target


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    target = output_file_target(path)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, target)
    except OSError as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise CaseError(f"{path}: cannot write: {exc.strerror or exc}") from None


# ----------------------------------------------------------------------------------------------
# Matrices.

def _format_rows(arr: np.ndarray) -> str:
    """%.9g round-trips float32 exactly; inf/nan print as 'inf', '-inf', 'nan'."""
    buf = io.StringIO()
    np.savetxt(buf, np.asarray(arr, dtype=np.float32).astype(np.float64), fmt="%.9g", delimiter=" ")
    return buf.getvalue()


def matrix_bytes(arr: np.ndarray, fmt: str, header: Optional[str] = None) -> bytes:
    if fmt == "npy":
        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(arr, dtype="<f4"), allow_pickle=False)
        return buf.getvalue()
    text = (f"# {header}\n" if header else "") + _format_rows(arr)
    return text.encode("ascii")


def write_matrix(path: Path, arr: np.ndarray, fmt: str, header: Optional[str] = None) -> None:
    atomic_write_bytes(path, matrix_bytes(arr, fmt, header))


# The number syntax both readers accept (cuda_src/io/matrix_io.cpp has the same rule).
_NUMBER = re.compile(r"^[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf|infinity|nan)$", re.IGNORECASE)
_BLANK_LINE = re.compile(r"\n[ \t\r]*\n")  # starts with a literal: fast on 100 MB files
_SEPARATORS = re.compile(r"[ \t\r]+")  # the binary separates values by spaces and tabs only


def _first_bad_token(tokens: List[str]) -> Optional[int]:
    for j, tok in enumerate(tokens):
        if not _NUMBER.match(tok):
            return j
    return None


def _needs_precise_pass(text: str) -> bool:
    """What np.loadtxt would accept but the contract does not: a blank line before a row, a '#'
    after a value, form feeds or vertical tabs. Substring counts, not regexes over every line,
    keep this at memory speed."""
    if "\f" in text or "\v" in text or not text.lstrip(" \t\r").strip():
        return True
    if text.count("#") != text.count("\n#") + text.startswith("#"):
        return True  # a '#' that does not open a line
    if re.match(r"[ \t\r]*\n", text):
        return True  # a leading blank line
    blank = _BLANK_LINE.search(text)
    return blank is not None and bool(text[blank.end():].strip())  # trailing blank lines are fine


def _fast_parse(text: str) -> Optional[np.ndarray]:
    """NumPy's C parser for well-formed files; None when anything is off, so that the precise
    line-by-line pass below finds and names the problem."""
    if _needs_precise_pass(text):
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "empty input" warnings: the precise pass reports it
            mat = np.loadtxt(io.StringIO(text), dtype=np.float64, comments="#", ndmin=2)
    except ValueError:
        return None
    return mat if mat.size else None


def parse_text_matrix(data: bytes, name: str, shape: Optional[Tuple[int, int]] = None,
                      allow_nonfinite: bool = True) -> np.ndarray:
    """Strict parse of one text matrix. `shape` (rows, cols) when known; errors name line:col."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as exc:
        raise CaseError(f"{name}: not a text matrix (non-ASCII byte at offset {exc.start}); "
                        "HINT: is it a .npy file with the wrong extension?") from None
    mat = _fast_parse(text)
    linenos = None
    if mat is None or (shape and mat.shape != tuple(shape)):
        mat, linenos = _precise_parse(text, name, shape)
    with np.errstate(over="ignore"):
        mat32 = mat.astype(np.float32)
    overflow = np.argwhere(np.isfinite(mat) & ~np.isfinite(mat32))
    if overflow.size:
        r, c = (int(x) for x in overflow[0])
        raise CaseError(f"{name}:{_where(r, c, linenos, text)}: value {mat[r, c]:.9g} overflows float32")
    if not allow_nonfinite:
        _reject_nonfinite(mat32, name, linenos, text)
    return mat32


def _precise_parse(text: str, name: str, shape) -> Tuple[np.ndarray, List[int]]:
    """Line by line: names the first ragged row, bad token or blank line with line:col."""
    rows: List[Tuple[int, List[str]]] = []
    blank_at = None
    lines = text.split("\n")
    for lineno, line in enumerate(lines, start=1):
        stripped = line.strip(" \t\r")
        if stripped.startswith("#"):
            continue
        if not stripped:
            blank_at = blank_at or lineno
            continue
        if blank_at is not None:
            raise CaseError(f"{name}:{blank_at}: blank line inside the matrix; "
                            "HINT: one matrix row per line, no empty lines")
        rows.append((lineno, _SEPARATORS.split(stripped)))
    if not rows:
        raise CaseError(f"{name}: empty file: no matrix rows")
    want_cols = shape[1] if shape else len(rows[0][1])
    for lineno, tokens in rows:
        j = _first_bad_token(tokens)
        if j is not None:
            col = _char_column(lines[lineno - 1], tokens, j)
            raise CaseError(f"{name}:{lineno}:{col}: not a number: {tokens[j][:40]!r}")
        if len(tokens) != want_cols:
            what = "missing values" if len(tokens) < want_cols else "extra values"
            raise CaseError(f"{name}:{lineno}: {what}: {len(tokens)} values on this row, expected "
                            f"{want_cols}; HINT: a ragged or truncated row")
    if shape and len(rows) != shape[0]:
        raise CaseError(f"{name}:{rows[-1][0]}: {len(rows)} rows, expected {shape[0]}; "
                        "HINT: the file is truncated or has extra rows")
    flat = np.array([tok for _, tokens in rows for tok in tokens], dtype=np.float64)
    return flat.reshape(len(rows), want_cols), [ln for ln, _ in rows]


def _char_column(line: str, tokens: List[str], j: int) -> int:
    """1-based character column of token j in line (the binary's column convention)."""
    pos = 0
    for i, tok in enumerate(tokens):
        pos = line.index(tok, pos)
        if i == j:
            break
        pos += len(tok)
    return pos + 1


def _where(r: int, c: int, linenos: Optional[List[int]], text: Optional[str] = None) -> str:
    """line:col of matrix element (r, c), 1-based."""
    if linenos is None and text is not None:
        linenos = [i for i, ln in enumerate(text.split("\n"), start=1)
                   if ln.strip() and not ln.strip().startswith("#")]
    return f"{linenos[r]}:{c + 1}" if linenos else f"row {r}, col {c}"


def _reject_nonfinite(mat: np.ndarray, name: str, linenos: Optional[List[int]] = None,
                      text: Optional[str] = None) -> None:
    bad = np.argwhere(~np.isfinite(mat))
    if bad.size:
        r, c = (int(x) for x in bad[0])
        where = _where(r, c, linenos, text) if (linenos or text) else f"row {r}, col {c}"
        raise CaseError(f"{name}:{where}: {mat[r, c]} in an input ({len(bad)} non-finite values); "
                        "HINT: inputs must be finite (--allow-nonfinite to accept them)")


_NPY_MAGIC = b"\x93NUMPY"


def _npy_header(data: bytes) -> dict:
    """The header dict as written (call after np.load has read it, so it is a valid one)."""
    start, size = (10, int.from_bytes(data[8:10], "little")) if data[6] == 1 else (12, int.from_bytes(data[8:12], "little"))
    return ast.literal_eval(data[start:start + size].decode("latin1"))


def parse_npy_matrix(data: bytes, name: str, shape: Optional[Tuple[int, int]] = None,
                     allow_nonfinite: bool = True) -> np.ndarray:
    if not data.startswith(_NPY_MAGIC):  # np.load would open a zip archive as an NpzFile
        raise CaseError(f"{name}: not a .npy file (bad magic)")
    buf = io.BytesIO(data)
    try:
        arr = np.load(buf, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise CaseError(f"{name}: not a valid .npy file ({str(exc).splitlines()[0]})") from None
    extra = len(data) - buf.tell()
    if extra:
        raise CaseError(f"{name}: {extra} bytes after the array data; HINT: the file is damaged; regenerate it")
    if arr.dtype != np.dtype("<f4"):
        raise CaseError(f"{name}: dtype {arr.dtype}, expected float32 ('<f4'); "
                        "HINT: save with arr.astype(np.float32)")
    # np.load also takes 'f4' or '=f4', and Fortran order; the contract (and the binary) does not.
    header = _npy_header(data)
    if header["descr"] != "<f4":
        raise CaseError(f"{name}: dtype descr {header['descr']!r}, expected '<f4'")
    if header["fortran_order"]:
        raise CaseError(f"{name}: fortran_order arrays are not supported; HINT: save np.ascontiguousarray(arr)")
    if arr.ndim != 2:
        raise CaseError(f"{name}: {arr.ndim}-d array, expected a 2-d matrix")
    if shape and tuple(arr.shape) != tuple(shape):
        raise CaseError(f"{name}: shape {arr.shape[0]}x{arr.shape[1]}, expected {shape[0]}x{shape[1]}")
    if not allow_nonfinite:
        _reject_nonfinite(arr, name)
    return arr


_FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _not_regular(path, mode: int) -> CaseError:
    kind = next((word for is_kind, word in _FILE_KINDS if is_kind(mode)), "a special file")
    return CaseError(f"{path}: is {kind}, not a regular file; "
                     "HINT: only regular files are read (a symlink to one is fine)")


def matrix_max_bytes(shape: Tuple[int, int], fmt: str, itemsize: int = 4) -> int:
    """The largest file a rows × cols matrix may take in `fmt` (the bounds in verify/stages.py);
    itemsize: the widest .npy element accepted (float32 inputs; stage files may be float64)."""
    values = shape[0] * shape[1]
    if fmt == "npy":
        return 12 + NPY_MAX_HEADER_BYTES + itemsize * values
    return TEXT_BYTES_PER_VALUE * values + TEXT_SLACK_BYTES


def read_bytes(path: Path, shape: Optional[Tuple[int, int]] = None, itemsize: int = 4) -> bytes:
    """The bytes of a regular file (after symlinks: a FIFO would block, /dev/zero never ends).
    With `shape`, a file larger than a matrix of that shape may take (format from the name) is
    refused before it is read."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CaseError(f"{path}: missing file") from None
    except OSError as exc:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode) from None
        raise CaseError(f"{path}: cannot read: {exc.strerror or exc}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _not_regular(path, info.st_mode)
    with os.fdopen(fd, "rb") as fh:
        if shape is not None:
            fmt = "npy" if str(path).endswith(".npy") else "txt"
            most = matrix_max_bytes(shape, fmt, itemsize)
            if info.st_size > most:
                raise CaseError(f"{path}: {info.st_size} bytes is more than a {fmt} matrix of {shape[0]} x "
                                f"{shape[1]} values may take ({most} bytes); HINT: the file is not this matrix")
        try:
            return fh.read()
        except OSError as exc:
            raise CaseError(f"{path}: cannot read: {exc.strerror or exc}") from None


def parse_matrix(data: bytes, path: Path, shape=None, allow_nonfinite=True) -> np.ndarray:
    parse = parse_npy_matrix if str(path).endswith(".npy") else parse_text_matrix
    return parse(data, str(path), shape, allow_nonfinite)


def read_matrix(path: Path, shape=None, allow_nonfinite=True) -> np.ndarray:
    return parse_matrix(read_bytes(path, shape), path, shape, allow_nonfinite)


def crc32_hex(data: bytes) -> str:
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def text_header_fields(data: bytes) -> Dict[str, str]:
    """`# attnstep stage=QK head=3 ... run=ID` -> {"stage": "QK", ...}; {} when absent."""
    first = data[:512].split(b"\n", 1)[0].decode("ascii", "replace")
    if not first.startswith("# attnstep"):
        return {}
    return dict(tok.split("=", 1) for tok in first[2:].split() if "=" in tok)


# ----------------------------------------------------------------------------------------------
# Manifests: flat `key = value` TOML.

INPUT_KEYS = {**{k: int for k in DIM_KEYS}, "causal": bool, "scale": float, "format": str,
              "seed": int, "distribution": str, "generator": str}
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
            raise CaseError(f"{where}: '{key}' must be {_TYPE_WORDS[want]} (got {v!r})")


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


def read_toml(path: Path) -> dict:
    data = read_bytes(path)
    # ASCII without control characters (tabs and line ends aside, a CR only before a line feed),
    # as the binary's reader.
    bad = re.search(rb"[^\t\n\r\x20-\x7e]|\r(?!\n)", data)
    if bad:
        raise CaseError(f"{path}:{_line_col(data, bad.start())}: byte 0x{data[bad.start()]:02X} in the "
                        "manifest (ASCII text only)")
    multi = _MULTILINE_STRING.search(data)
    if multi:
        raise CaseError(f"{path}:{_line_col(data, multi.start(1))}: multi-line strings are not supported")
    try:
        return tomllib.loads(data.decode("ascii"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise CaseError(f"{path}: not a valid manifest ({exc})") from None


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("inf" if v > 0 else "-inf") if not math.isnan(v) else "nan"
    if isinstance(v, int):
        return str(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_toml(path: Path, values: dict, comment: str) -> None:
    body = f"# {comment}\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items())
    atomic_write_bytes(path, body.encode("utf-8"))


def validate_dims(values: dict, where: str) -> Dims:
    for key in DIM_KEYS:
        v = values.get(key)
        if not isinstance(v, int) or isinstance(v, bool):
            raise CaseError(f"{where}: '{key}' must be an integer (got {v!r})")
        if not 1 <= v <= MAX_DIM:
            raise CaseError(f"{where}: '{key}' = {v}: dimensions must be in 1..{MAX_DIM}")
    for key in ("d_k", "d_v"):
        if values[key] > MAX_HEAD_DIM:
            raise CaseError(f"{where}: '{key}' = {values[key]}: at most {MAX_HEAD_DIM} is supported")
    dims = Dims(*(values[k] for k in DIM_KEYS))
    _check_case_limits(dims, where)
    return dims


def _check_case_limits(dims: Dims, where: str) -> None:
    """Dimensions each in range can still make a case too large (verify/stages.py MAX_HEADS,
    MAX_ELEMENTS; the binary's case_limit_violation says the same)."""
    heads = dims.total_heads
    hint = "HINT: split the work into smaller cases (fewer heads or shorter sequences)"
    if heads > MAX_HEADS:
        raise CaseError(f"{where}: the case is too large: batch x heads = {heads} heads; at most {MAX_HEADS}; {hint}")
    per_head = dims.elements_per_head
    if per_head * heads > MAX_ELEMENTS:
        raise CaseError(f"{where}: the case is too large: {heads} heads of {per_head} stage elements each; "
                        f"at most {MAX_ELEMENTS} elements in all; {hint}")


# ----------------------------------------------------------------------------------------------
# Input cases.

@dataclass
class InputCase:
    path: Path
    dims: Dims
    fmt: str
    causal: bool = False
    scale: Optional[float] = None  # None: 1/sqrt(d_k)
    manifest: bool = False         # the case has a manifest (which then says causal and scale)
    arrays: Optional[Dict[str, np.ndarray]] = None  # Q, K, V as (heads, rows, cols): the Python API
    allow_nonfinite: bool = False  # NaN/inf in Q/K/V load instead of being an error

    def file(self, name: str, head: int) -> Path:
        return self.path / stage_file(name, head, self.fmt)

    def load(self, name: str, head: int) -> np.ndarray:
        if self.arrays is not None:
            return self.arrays[name][head]
        shape = STAGES[name].shape(self.dims)
        return read_matrix(self.file(name, head), shape, allow_nonfinite=self.allow_nonfinite)


def _head_files(folder: Path) -> Dict[Tuple[str, int], List[str]]:
    """(name, head) -> the formats present, from the names Q/K/V_head_<i>.<txt|npy> (head numbers
    without leading zeros, as the binary lists them)."""
    found: Dict[Tuple[str, int], List[str]] = {}
    for entry in sorted(os.listdir(folder)):
        parsed = parse_stage_file(entry)
        if parsed and parsed[0] in INPUT_NAMES and entry == stage_file(*parsed):
            found.setdefault((parsed[0], parsed[1]), []).append(parsed[2])
    return found


def _format_of_files(folder: Path, files) -> Optional[str]:
    """The format Q_head_0 is in (None when it is absent); both at once is ambiguous."""
    formats = files.get(("Q", 0), [])
    if len(formats) > 1:
        raise CaseError(f"{folder}: both Q_head_0.txt and Q_head_0.npy exist; HINT: remove one, or add "
                        f"format = \"txt\" (or \"npy\") to {INPUT_MANIFEST}")
    return formats[0] if formats else None


def load_input_case(folder: Path) -> InputCase:
    """Reads the manifest (or infers shapes from the files) and checks the layout is complete."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CaseError(f"{folder}: input case folder not found; HINT: run 'attnstep generate' first")
    files = _head_files(folder)
    manifest = folder / INPUT_MANIFEST
    if manifest.exists():
        values = read_toml(manifest)
        unknown = sorted(set(values) - set(INPUT_KEYS))
        if unknown:
            raise CaseError(f"{manifest}: unknown key '{unknown[0]}'")
        check_types(values, INPUT_KEYS, str(manifest))
        dims = validate_dims(values, str(manifest))
        # Without a `format` line the files say, as the binary reads it.
        fmt = values["format"] if "format" in values else _format_of_files(folder, files) or FORMATS[0]
        if fmt not in FORMATS:
            raise CaseError(f"{manifest}: format = {fmt!r}; expected one of {', '.join(FORMATS)}")
        scale = check_scale(values["scale"], str(manifest)) if "scale" in values else None
        case = InputCase(folder, dims, fmt, values.get("causal", False), scale, manifest=True)
    else:
        case = _infer_case(folder, files)
    _check_layout(case, files)
    return case


def _infer_case(folder: Path, files) -> InputCase:
    heads = 0
    while ("Q", heads) in files:
        heads += 1
    if heads == 0:
        raise CaseError(f"{folder}: no Q_head_0.txt or Q_head_0.npy and no {INPUT_MANIFEST}; "
                        "HINT: is this an input case folder?")
    fmt = _format_of_files(folder, files)
    q = read_matrix(folder / stage_file("Q", 0, fmt))
    k = read_matrix(folder / stage_file("K", 0, fmt)) if ("K", 0) in files else None
    v = read_matrix(folder / stage_file("V", 0, fmt)) if ("V", 0) in files else None
    if k is None or v is None:
        missing = "K" if k is None else "V"
        raise CaseError(f"{folder / stage_file(missing, 0, fmt)}: missing file (Q_head_0 exists)")
    if k.shape[1] != q.shape[1]:
        raise CaseError(f"{folder / stage_file('K', 0, fmt)}: {k.shape[1]} columns but Q_head_0 has "
                        f"{q.shape[1]}; HINT: Q and K must share d_k")
    if v.shape[0] != k.shape[0]:
        raise CaseError(f"{folder / stage_file('V', 0, fmt)}: {v.shape[0]} rows but K_head_0 has "
                        f"{k.shape[0]}; HINT: K and V must share seq_k")
    values = dict(batch=1, heads=heads, seq_q=q.shape[0], seq_k=k.shape[0], d_k=q.shape[1], d_v=v.shape[1])
    return InputCase(folder, validate_dims(values, str(folder)), fmt)


def _check_layout(case: InputCase, files) -> None:
    """Every head's Q, K, V in the case's format; no head beyond the case; no file of the other
    format (which one would be meant?), as the binary checks."""
    total = case.dims.total_heads
    for i in range(total):
        for name in INPUT_NAMES:
            if case.fmt not in files.get((name, i), ()):
                raise CaseError(f"{case.file(name, i)}: missing file ({total} heads expected)")
    for (name, i), formats in sorted(files.items(), key=lambda kv: kv[0][::-1]):
        other = [f for f in formats if f != case.fmt]
        if other:
            raise CaseError(f"{case.path / stage_file(name, i, other[0])}: a .{other[0]} file in a .{case.fmt} "
                            "case; HINT: a case holds one format; remove the stray file")
        if i >= total:
            raise CaseError(f"{case.path / stage_file(name, i, formats[0])}: unexpected file: the case has "
                            f"{total} heads (0..{total - 1})")


def input_head_files(folder: Path) -> List[str]:
    """The names of the Q/K/V head files in `folder`."""
    return [stage_file(name, i, fmt) for (name, i), formats in _head_files(folder).items() for fmt in formats]


def clear_input_files(folder: Path) -> None:
    """Removes an earlier case's Q/K/V head files and manifest, so no stale head survives."""
    for name in input_head_files(folder):
        (folder / name).unlink()
    (folder / INPUT_MANIFEST).unlink(missing_ok=True)
