"""Matrix files: strict reading and writing of text and .npy matrices, regular files only, atomic
writes (a file appears complete or not at all).

Every user error is a CaseError whose message is one line naming the file (and line and column
where they apply); the CLI turns it into exit status 2. cuda_src/io/matrix_io.cpp is the binary's
twin of this reader: both accept exactly the same files.
"""
from __future__ import annotations

import io
import os
import re
import stat
import tempfile
import warnings
import zlib
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..stages import NPY_MAX_HEADER_BYTES, TEXT_BYTES_PER_VALUE, TEXT_SLACK_BYTES
from ..text import plural, printable
from .kinds import CaseError, file_kind, new_temp_file, not_regular, own_name, refuse_unreadable_kind
from .npy_bytes import NpyExpect, load_npy, npy_header, oversized_npy

# How much of a token that is not a number an error quotes.
QUOTED_TOKEN_LIMIT = 40


# ----------------------------------------------------------------------------------------------
# Atomic writes: a file appears complete or not at all.

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


def probe_writable(folder: Path, what: Path) -> None:
    """Refuses `what` when no file can be created in `folder` (permissions, a read-only or virtual
    file system): creating and removing one is the only test that holds for every user, root too."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".attnstep-probe-", dir=folder)
    except OSError as exc:
        raise CaseError(f"{what}: cannot write into {folder}: {exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(probe)


def remove_own_file(path: Path, what: str) -> None:
    """Removes a file attnstep wrote (a marker, findings) if it is there; CaseError naming `what`
    when it is there and cannot be removed."""
    try:
        os.unlink(path)
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as exc:
        raise CaseError(f"{path}: cannot remove {what}: {exc.strerror or exc}") from None


def atomic_write_bytes(path: Path, data: bytes, through_links: bool = True) -> None:
    """Writes `data` to a new temporary file and renames it over `path`. through_links: a link at
    `path` is kept and the file it points to replaced (a report the user links elsewhere);
    otherwise the link itself is replaced (files we name inside a folder, such as plots)."""
    path = Path(path)
    target = output_file_target(path) if through_links else own_name(path)
    tmp = None
    try:
        fd, tmp = new_temp_file(target)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, target)
    except OSError as exc:
        if tmp is not None:
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


# The number syntax both readers accept (cuda_src/io/text_format.cpp has the same rule).
_NUMBER = re.compile(r"^[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|inf|infinity|nan)$", re.IGNORECASE)
_HEX = re.compile(r"^[+-]?0[xX][0-9a-fA-F]*\.?[0-9a-fA-F]*(?:[pP][+-]?\d+)?$")  # C's %a: named in the error
_BLANK_LINE = re.compile(r"\n[ \t\r]*\n")  # starts with a literal: fast on 100 MB files
_SEPARATORS = re.compile(r"[ \t\r]+")  # the binary separates values by spaces and tabs only


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
    beyond = _number_read_as_inf(mat, text)  # past float64 too: NumPy read it as ±inf
    if overflow.size or beyond:
        lineno, col, tok = beyond or _token_at(text, *(int(x) for x in overflow[0]))
        raise CaseError(f"{name}:{lineno}:{col}: value '{printable(tok, QUOTED_TOKEN_LIMIT)}' overflows float32")
    if not allow_nonfinite:
        _reject_nonfinite(mat32, name, linenos, text)
    return mat32


# A number NumPy may read as ±inf: an exponent of three digits or more, or hundreds of digits
# (float64 ends near 1.8e308). The text is searched for one at C speed before any token is looked
# at: a masked stage's file holds -inf by the million, and no such number.
_PAST_FLOAT64 = re.compile(r"[eE]\+?0*[1-9][0-9]{2}|[0-9]{300}")


def _number_read_as_inf(mat: np.ndarray, text: str) -> Optional[Tuple[int, int, str]]:
    """(line, character column, token) of the first element written as a number too large even for
    float64 (1e400 reads as inf): an overflow, as the binary names it, where a spelled-out inf is a
    non-finite value."""
    if not _PAST_FLOAT64.search(text):
        return None
    rows, lines = text_rows(text, ""), text.split("\n")
    for r, c in np.argwhere(np.isinf(mat)):
        place = _place(rows, lines, int(r), int(c))
        if any(ch.isdigit() for ch in place[2]):
            return place
    return None


def _token_at(text: str, r: int, c: int) -> Tuple[int, int, str]:
    """_place of one element of a text matrix that parsed (an error's path only: it splits the
    whole text)."""
    return _place(text_rows(text, ""), text.split("\n"), r, c)


def _place(rows: List[Tuple[int, List[str]]], lines: List[str], r: int, c: int) -> Tuple[int, int, str]:
    """(line, character column, token) of matrix element (r, c): the binary's way of placing a value."""
    lineno, tokens = rows[r]
    return lineno, char_column(lines[lineno - 1], tokens, c), tokens[c]


def text_rows(text: str, name: str) -> List[Tuple[int, List[str]]]:
    """The rows of a text matrix, each (line number, its tokens): comments skipped, a blank line
    before a row refused (line:col), an empty file refused."""
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
    return rows


def check_row_length(name: str, lineno: int, tokens: List[str], want_cols: int) -> None:
    if len(tokens) != want_cols:
        what = "missing values" if len(tokens) < want_cols else "extra values"
        raise CaseError(f"{name}:{lineno}: {what}: {plural(len(tokens), 'value')} on this row, expected "
                        f"{want_cols}; HINT: a ragged or truncated row")


def _precise_parse(text: str, name: str, shape) -> Tuple[np.ndarray, List[int]]:
    """Line by line: names the first ragged row, bad token or blank line with line:col."""
    rows = text_rows(text, name)
    lines = text.split("\n")
    want_cols = shape[1] if shape else len(rows[0][1])
    for lineno, tokens in rows:
        j = next((j for j, tok in enumerate(tokens) if not _NUMBER.match(tok)), None)
        if j is not None:
            col = char_column(lines[lineno - 1], tokens, j)
            hex_hint = "; HINT: hexadecimal floats (%a) are not read: print %.9g" if _HEX.match(tokens[j]) else ""
            raise CaseError(f"{name}:{lineno}:{col}: not a number: '{printable(tokens[j], QUOTED_TOKEN_LIMIT)}'"
                            f"{hex_hint}")
        check_row_length(name, lineno, tokens, want_cols)
    if shape and len(rows) != shape[0]:
        raise CaseError(f"{name}:{rows[-1][0]}: {plural(len(rows), 'row')}, expected {shape[0]}; "
                        "HINT: the file is truncated or has extra rows")
    flat = np.array([tok for _, tokens in rows for tok in tokens], dtype=np.float64)
    return flat.reshape(len(rows), want_cols), [ln for ln, _ in rows]


def char_column(line: str, tokens: List[str], j: int) -> int:
    """1-based character column of token j in line (the binary's column convention)."""
    pos = 0
    for i, tok in enumerate(tokens):
        pos = line.index(tok, pos)
        if i == j:
            break
        pos += len(tok)
    return pos + 1


def element_where(r: int, c: int, linenos: Optional[List[int]], text: Optional[str] = None) -> str:
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
        where = element_where(r, c, linenos, text) if (linenos or text) else f"row {r}, col {c}"
        raise CaseError(f"{name}:{where}: {mat[r, c]} in an input ({len(bad)} non-finite values); "
                        "HINT: inputs must be finite (--allow-nonfinite to accept them)")


# What an input matrix's .npy file holds (parse_npy_matrix's tests, in its words).
INPUT_NPY = NpyExpect(("<f4", "<f2"), "float32 ('<f4') or float16 ('<f2')", "save with arr.astype(np.float32)", True)


def parse_npy_matrix(data: bytes, name: str, shape: Optional[Tuple[int, int]] = None,
                     allow_nonfinite: bool = True) -> np.ndarray:
    arr = load_npy(data, name)
    if arr.dtype.str not in INPUT_NPY.descrs:
        raise CaseError(f"{name}: dtype {arr.dtype}, expected {INPUT_NPY.words}; HINT: {INPUT_NPY.hint}")
    # np.load also takes 'f4' or '=f4', and Fortran order; the contract (and the binary) does not.
    header = npy_header(data)
    if header["descr"] not in INPUT_NPY.descrs:
        raise CaseError(f"{name}: dtype descr {header['descr']!r}, expected '<f4' or '<f2'")
    arr = arr.astype(np.float32)  # an fp16 input: each value exactly
    if header["fortran_order"]:
        raise CaseError(f"{name}: fortran_order arrays are not supported; HINT: save np.ascontiguousarray(arr)")
    if arr.ndim != 2:
        raise CaseError(f"{name}: {arr.ndim}-d array, expected a 2-d matrix")
    if shape and tuple(arr.shape) != tuple(shape):
        raise CaseError(f"{name}: shape {arr.shape[0]}x{arr.shape[1]}, expected {shape[0]}x{shape[1]}")
    if not allow_nonfinite:
        _reject_nonfinite(arr, name)
    return arr


def matrix_max_bytes(shape: Tuple[int, int], fmt: str, itemsize: int = 4) -> int:
    """The largest file a rows × cols matrix may take in `fmt` (the bounds in verify/stages.py);
    itemsize: the widest .npy element accepted (float32 inputs; stage files may be float64)."""
    values = shape[0] * shape[1]
    if fmt == "npy":
        return 12 + NPY_MAX_HEADER_BYTES + itemsize * values
    return TEXT_BYTES_PER_VALUE * values + TEXT_SLACK_BYTES


def read_bytes(path: Path, shape: Optional[Tuple[int, int]] = None, itemsize: int = 4,
               expect: Optional[NpyExpect] = None) -> bytes:
    """The bytes of a regular file (after symlinks: a FIFO would block, /dev/zero never ends,
    /proc/self/environ is no matrix). With `shape`, a file larger than a matrix of that shape may
    take (format from the name) is refused before it is read; `expect`: what the reader's .npy
    files hold, so that the refusal of one says from its header what it holds instead."""
    refuse_unreadable_kind(path)
    try:
        # O_NONBLOCK: should the file have been swapped for a FIFO since, opening it must not wait
        # for a writer; fstat then refuses it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CaseError(f"{path}: missing file") from None
    except OSError as exc:
        raise CaseError(f"{path}: cannot read: {exc.strerror or exc}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise not_regular(path, info.st_mode)
    with os.fdopen(fd, "rb") as fh:
        try:
            if shape is not None:
                _refuse_oversized(fh, path, shape, info.st_size, itemsize, expect)
            return fh.read()
        except OSError as exc:
            raise CaseError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _refuse_oversized(fh, path: Path, shape: Tuple[int, int], size: int, itemsize: int,
                      expect: Optional[NpyExpect]) -> None:
    """read_bytes' refusal of a file larger than a `shape` matrix may take (a .npy file's header,
    where the reader says what its files hold, may say why)."""
    fmt = "npy" if str(path).endswith(".npy") else "txt"
    most = matrix_max_bytes(shape, fmt, itemsize)
    if size <= most:
        return
    said = None
    if fmt == "npy" and expect is not None:
        said = oversized_npy(fh.read(12 + NPY_MAX_HEADER_BYTES), str(path), shape, expect)
    raise CaseError(said or f"{path}: {plural(size, 'byte')} is more than a {fmt} matrix of {shape[0]} x {shape[1]} "
                    f"values may take ({most} bytes); HINT: the file is not this matrix")


def wrong_shape(name: str, got: Tuple[int, ...], want: Tuple[int, int], symbols: str) -> str:
    """A stage file's shape problem in one line; rows and columns swapped, how a column-major write
    (cuBLAS's order) shows, is named as such."""
    turned = "; it is the transpose (written column-major?)" if tuple(got) == tuple(want)[::-1] else ""
    return f"{name} is {got[0]}x{got[1]}, expected {want[0]}x{want[1]} ({symbols}){turned}"


def parse_matrix(data: bytes, path: Path, shape=None, allow_nonfinite=True) -> np.ndarray:
    parse = parse_npy_matrix if str(path).endswith(".npy") else parse_text_matrix
    return parse(data, str(path), shape, allow_nonfinite)


def read_matrix(path: Path, shape=None, allow_nonfinite=True) -> np.ndarray:
    return parse_matrix(read_bytes(path, shape, expect=INPUT_NPY), path, shape, allow_nonfinite)


def crc32_hex(data: bytes) -> str:
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def text_header_fields(data: bytes) -> Dict[str, str]:
    """`# attnstep stage=QK head=3 ... run=ID` -> {"stage": "QK", ...}; {} when absent."""
    first = data[:512].split(b"\n", 1)[0].decode("ascii", "replace")
    if not first.startswith("# attnstep"):
        return {}
    return dict(tok.split("=", 1) for tok in first[2:].split() if "=" in tok)
