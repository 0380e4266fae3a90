"""The bytes of a .npy file, read as strictly as the binary reads them (cuda_src/io/npy_format.cpp):
the header found and bounded before np.load sees it, the data the size the header declares, and
whatever np.load refuses named in one line (CaseError) with the file.
"""
from __future__ import annotations

import ast
import io
import tokenize
from typing import NamedTuple, Optional, Tuple

import numpy as np

from ..stages import NPY_MAX_HEADER_BYTES
from ..text import plural
from .kinds import CaseError

_NPY_MAGIC = b"\x93NUMPY"


def npy_header_span(data: bytes) -> Tuple[int, int]:
    """Where the header dict of a .npy file (its magic checked) starts and ends: after the
    version-dependent length field, for the length it gives (cut at the file's end)."""
    if len(data) < 12:
        return len(data), len(data)
    if data[6] == 1:  # version 1.0: a 2-byte length, else 4 bytes
        start, size = 10, int.from_bytes(data[8:10], "little")
    else:
        start, size = 12, int.from_bytes(data[8:12], "little")
    return start, min(len(data), start + size)


def npy_header(data: bytes) -> dict:
    """The header dict as written (call after np.load has read it, so it is a valid one)."""
    start, end = npy_header_span(data)
    return ast.literal_eval(data[start:end].decode("latin1"))


_ZIP_MAGIC = b"PK\x03\x04"  # what np.savez writes: np.load would hand back an NpzFile


def check_npy_size(data: bytes, name: str) -> None:
    """Refuses, before np.load allocates the array its header declares, a file that is not one
    .npy array or whose data is not the size its header declares (shape (10^9, 10^9) in a small
    file would ask for exabytes). A header this cannot read is left for np.load to name."""
    if data.startswith(_ZIP_MAGIC):
        raise CaseError(f"{name}: an .npz archive, not an .npy file; HINT: save one array with np.save")
    if not data.startswith(_NPY_MAGIC):
        raise CaseError(f"{name}: not a .npy file (bad magic)")
    start, end = npy_header_span(data)
    if end - start > NPY_MAX_HEADER_BYTES:
        return  # np.load refuses a header this long without reading it
    try:
        header = npy_header(data)
        shape, dtype = tuple(header["shape"]), np.dtype(header["descr"])
    except Exception:  # any malformed header: np.load's own message names it
        return
    if dtype.hasobject:  # its data is a pickle, whose length the header does not give
        raise CaseError(pickled_array(name, header["descr"]))
    itemsize = dtype.itemsize
    if not all(isinstance(n, int) and n >= 0 for n in shape):
        return
    declared = itemsize
    for n in shape:
        declared *= n
    held = len(data) - end
    if declared > held:
        raise CaseError(f"{name}: its header declares shape {shape} of {header['descr']!r}, {plural(declared, 'byte')} "
                        f"of data, but the file holds {plural(held, 'byte')} after the header; HINT: the file is "
                        "truncated or damaged; regenerate it")
    if declared < held:
        raise CaseError(f"{name}: {plural(held - declared, 'byte')} after the array data; HINT: the file is damaged; "
                        "regenerate it")


def pickled_array(name: str, descr) -> str:
    """The message for a .npy file of Python objects (np.save of an object array pickles it)."""
    return (f"{name}: holds Python objects (dtype {descr!r}: a pickled array), not numbers; HINT: convert them "
            "before np.save, e.g. np.asarray(a, dtype=np.float32)")


class NpyExpect(NamedTuple):
    """What a reader's .npy files may hold, to say why one too large for its matrix is refused."""
    descrs: Tuple[str, ...]  # the dtypes it takes, as a header spells them
    words: str               # those dtypes, as its messages name them
    hint: str
    exact_shape: bool        # the shape it is given is the matrix's own, 2-d (else a bound on the size)


def oversized_npy(head: bytes, name: str, shape: Tuple[int, int], expect: NpyExpect) -> Optional[str]:
    """Why a .npy file is larger than a `shape` matrix may take, from its first bytes (`head`: its
    header whole), tested in the order the reader tests a file it reads: Python objects, a dtype it
    does not take (float64 where float32 is expected: NumPy's default), then, for an exact shape,
    Fortran order, the rank and the shape. None where the header does not say (not a .npy header)."""
    if not head.startswith(_NPY_MAGIC):
        return None
    try:
        header = npy_header(head)
        descr, dims = header["descr"], tuple(header["shape"])
        dtype = np.dtype(descr)
    except Exception:  # a header cut short or malformed: the size is all there is to say
        return None
    if dtype.hasobject:
        return pickled_array(name, descr)
    if descr not in expect.descrs:
        return f"{name}: dtype {dtype}, expected {expect.words}; HINT: {expect.hint}"
    if not expect.exact_shape:
        return None
    if header.get("fortran_order"):
        return f"{name}: fortran_order arrays are not supported; HINT: save np.ascontiguousarray(arr)"
    if len(dims) != 2:
        return f"{name}: {len(dims)}-d array, expected a 2-d matrix"
    if dims != tuple(shape):
        return f"{name}: shape {dims[0]}x{dims[1]}, expected {shape[0]}x{shape[1]}"
    return None


def load_npy(data: bytes, name: str) -> np.ndarray:
    """A .npy file's array from its bytes (no pickles), its size checked first; CaseError naming
    `name` for whatever np.load refuses."""
    check_npy_size(data, name)
    if b"#" in data[slice(*npy_header_span(data))]:  # Python source to numpy, a comment: not the format's
        raise CaseError(f"{name}: not a valid .npy file (a '#' in its header)")
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise CaseError(f"{name}: not a valid .npy file ({str(exc).splitlines()[0]})") from None
    except (SyntaxError, tokenize.TokenError):  # numpy parses the header dict as Python source
        raise CaseError(f"{name}: not a valid .npy file (its header is not a dict literal)") from None
