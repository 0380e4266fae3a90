"""numpy's OpenBLAS: how many threads of its own it runs (a checking process shares the cores with
others, or calls it from several threads of its own)."""
from __future__ import annotations

import contextlib
import ctypes
from typing import List, Optional


# OpenBLAS's thread-count setter under the names its builds export (numpy's own wheels, older
# numpy wheels, a system OpenBLAS).
_OPENBLAS_SET_THREADS = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
                         "openblas_set_num_threads")


def _loaded_openblas() -> List[ctypes.CDLL]:
    """The OpenBLAS libraries mapped into this process (numpy's BLAS, where it is OpenBLAS)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line}
    except OSError:
        return []
    libs = []
    for path in sorted(paths):
        try:
            libs.append(ctypes.CDLL(path))
        except OSError:
            pass
    return libs


def one_blas_thread() -> bool:
    """Limits numpy's OpenBLAS to one thread in this process; False where it is not OpenBLAS. A
    worker is one of as many processes as cores: OpenBLAS's own threads (one a core, spinning
    between calls) would compete with the other workers for the cores."""
    return _set_blas_threads(1) is not None


def _set_blas_threads(n: int) -> Optional[int]:
    """Sets numpy's OpenBLAS to n threads; its count before (None where it is not OpenBLAS)."""
    before = None
    for lib in _loaded_openblas():
        setter = next((getattr(lib, s) for s in _OPENBLAS_SET_THREADS if hasattr(lib, s)), None)
        getter = next((getattr(lib, s.replace("_set_", "_get_")) for s in _OPENBLAS_SET_THREADS
                       if hasattr(lib, s.replace("_set_", "_get_"))), None)
        if setter is not None:
            before = int(getter()) if getter is not None else 1
            setter(n)
    return before


@contextlib.contextmanager
def blas_on_one_thread():
    """Within: OpenBLAS on one thread (the row tiles' threads each call it: its own threads would
    compete with them for the cores); its count before, after."""
    before = _set_blas_threads(1)
    try:
        yield
    finally:
        if before is not None:
            _set_blas_threads(before)


__all__ = ["one_blas_thread", "blas_on_one_thread"]
