"""The array namespace the model computes in: NumPy by default, PyTorch's float64 on a GPU when
the check runs there (check --device).

The model's functions take their namespace from their arguments (namespace(x)) and call only
its functions, so that one implementation runs on either. What the array API lacks and the model
needs goes through here, with a NumPy and a PyTorch branch. The check chooses the device for a
block of work (on_device); the reference code moves a head's arrays there once (to_device) and
brings the results back for the comparison (to_numpy). NumPy never imports PyTorch: it and
array_api_compat are imported only when a device other than NumPy's is asked for.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
import os
import sys
import warnings
from contextvars import ContextVar
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np

DEVICES = ("auto", "cpu", "cuda")

# None: NumPy; else the PyTorch device the model's arrays live on ("cuda", or "cpu" in the tests,
# which run PyTorch's float64 on the CPU: the same code the GPU runs).
_TARGET: ContextVar[Optional[str]] = ContextVar("attnstep array device", default=None)


class DeviceError(Exception):
    """A device was asked for that this machine cannot give (a one-line message)."""


def _torch():
    import torch  # noqa: PLC0415 -- only off the NumPy path
    return torch


# What the GPU path imports (the gpu extra): module, and its name for pip.
_GPU_MODULES = (("torch", "PyTorch"), ("array_api_compat", "array-api-compat"))


def _gpu_extra_missing() -> Optional[str]:
    """The first module of the gpu extra that is not installed (its pip name), or None."""
    return next((name for module, name in _GPU_MODULES if importlib.util.find_spec(module) is None), None)


def _cuda_state() -> Tuple[bool, str]:
    """Whether the gpu extra is installed and PyTorch sees a CUDA device, and why not. PyTorch can
    fail to import in more ways than ImportError (a CUDA library it loads missing: OSError), and
    its check of the driver may warn: neither reaches the check's output."""
    missing = _gpu_extra_missing()
    if missing:
        return False, f"{missing} is not installed (pip install 'attnstep[gpu]')"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch = _torch()
            if torch.cuda.is_available():
                return True, ""
            return False, f"PyTorch {torch.__version__} sees no CUDA device"
    except Exception as exc:  # noqa: BLE001 -- any failure to load PyTorch means no GPU here
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return False, f"PyTorch could not be loaded ({first})"


def cuda_visible() -> bool:
    """The gpu extra is installed and PyTorch sees a CUDA device."""
    return _cuda_state()[0]


def _gpu_may_exist() -> bool:
    """The gpu extra is installed and the machine has an NVIDIA device file: without both, auto
    picks the CPU without importing PyTorch (seconds of a check's start)."""
    return _gpu_extra_missing() is None and bool(glob.glob("/dev/nvidia[0-9]*"))


# auto takes the GPU for heads of at least this many scores (N·M): below, moving a head there and
# back costs about what its NumPy check does, and NumPy's worker processes share the heads out.
AUTO_MIN_SCORES = 1 << 22


def resolve_device(name: str, said: Optional[str] = None) -> str:
    """check --device's NAME, checked (`said`: how the user said it, for a message): cuda where
    PyTorch sees a CUDA device (else a DeviceError), cpu, or auto (decided per run: on_device)."""
    said = f"--device {name}" if said is None else said
    if name == "cuda":
        visible, why = _cuda_state()
        if not visible:
            raise DeviceError(f"{said}: {why}; use cpu")
    if name not in DEVICES:
        raise DeviceError(f"{said}: not one of {', '.join(DEVICES)}")
    return name


def device_argument(name: str, x) -> str:
    """The Python API's device= argument, resolved; a ValueError or TypeError names it."""
    if not isinstance(x, str):
        raise TypeError(f"{name}: expected one of {', '.join(DEVICES)}, got {type(x).__name__} {x!r}")
    try:
        return resolve_device(x, f"{name}={x!r}")
    except DeviceError as exc:
        raise ValueError(str(exc)) from None


@contextlib.contextmanager
def on_device(device: Optional[str], scores: int = 0, jobs: int = 0) -> Iterator[str]:
    """The model's reference arrays on `device` within the block, which it yields: "cpu" or None
    for NumPy, "cuda" for PyTorch on the GPU, "torch-cpu" for PyTorch on the CPU (the tests); "auto"
    is cuda for heads of AUTO_MIN_SCORES scores or more (`scores`: N·M) where PyTorch sees a CUDA
    device and no more than one process (`jobs`: check --jobs, 0 for the default) was asked for."""
    if device == "auto":
        device = "cuda" if (scores >= AUTO_MIN_SCORES and jobs <= 1 and _gpu_may_exist() and cuda_visible()) \
            else "cpu"
    target = {None: None, "cpu": None, "cuda": "cuda", "torch-cpu": "cpu"}[device]
    token = _TARGET.set(target)
    try:
        yield device or "cpu"
    finally:
        _TARGET.reset(token)


def device_jobs(device: str, jobs: int) -> int:
    """The processes that check heads on `device`: `jobs` on NumPy's; on a GPU one, this one, the
    heads one after another: the pool's workers are forked, and a process that has started CUDA
    cannot be forked (the child's CUDA state is unusable); one GPU runs one head's tiles at a time
    anyway."""
    return jobs if device == "cpu" else 1


def target() -> Optional[str]:
    """The PyTorch device the model computes on now, None for NumPy."""
    return _TARGET.get()


def visible_gpus() -> List[str]:
    """The CUDA devices this process sees, each named as CUDA_VISIBLE_DEVICES names it for a child
    process that should see that one alone (its index, or its entry of this process's own
    CUDA_VISIBLE_DEVICES); none where PyTorch sees none."""
    if not cuda_visible():
        return []
    count = _torch().cuda.device_count()
    said = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [s.strip() for s in said.split(",")] if said else [str(i) for i in range(count)]
    return names[:count]


def gpu_memory_bytes(count: int) -> Optional[int]:
    """The memory of the smallest of the first `count` CUDA devices this process sees, in bytes
    (None where it sees none, or cannot ask). PyTorch starts CUDA in this process to answer: a
    process that forks workers afterwards must not (the cluster's workers are started afresh)."""
    if not cuda_visible():
        return None
    cuda = _torch().cuda
    try:
        return min(cuda.get_device_properties(i).total_memory for i in range(min(count, cuda.device_count())))
    except (RuntimeError, ValueError):  # (a device that fails to start: the caller's default)
        return None


def device_now() -> str:
    """The on_device name of the device the model computes on now (what to give on_device to
    compute there again: a Dask worker's tasks, after check_run's block has ended)."""
    return {None: "cpu", "cuda": "cuda", "cpu": "torch-cpu"}[_TARGET.get()]


def to_device(x):
    """x as float64 on the current device (a NumPy array itself on NumPy's)."""
    device = _TARGET.get()
    if device is None:
        return np.asarray(x, dtype=np.float64)
    torch = _torch()
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=torch.float64)
    return torch.as_tensor(np.asarray(x, dtype=np.float64), device=device)


def to_numpy(x) -> np.ndarray:
    """x as a NumPy array (one transfer for a GPU tensor)."""
    if isinstance(x, np.ndarray) or np.isscalar(x):
        return np.asarray(x)
    x = x.detach()
    if x.device.type == "cpu":
        return x.numpy()
    # Into an array NumPy allocates: NumPy asks for huge pages for a large one, so the copy fills
    # memory that faults in 2 MB at a time; PyTorch's own host tensor faults 4 KB at a time, and
    # filled at about half the rate (docs/performance.md, scripts/time_host_copies.py).
    out = np.empty(tuple(x.shape), dtype=_numpy_dtype(x.dtype))
    _torch().from_numpy(out).copy_(x)
    return out


@functools.lru_cache(maxsize=None)
def _numpy_dtype(dtype) -> np.dtype:
    """The NumPy dtype of a PyTorch dtype (one NumPy has: float64, float32, integers, bool)."""
    return _torch().empty(0, dtype=dtype).numpy().dtype


def to_numpy_later(x) -> Callable[[], np.ndarray]:
    """A function that returns to_numpy(x). A CUDA tensor's copy to the host starts now, into
    page-locked memory, and the function waits for that copy alone: the kernels queued between
    now and the call run on meanwhile (to_numpy waits for all that is queued when it is called)."""
    if not _is_tensor(x) or x.device.type != "cuda":
        return lambda: to_numpy(x)
    torch = _torch()
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x.detach(), non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(x.device))  # (the stream the copy was queued on)

    def read() -> np.ndarray:
        done.synchronize()
        return host.numpy()
    return read


def _is_tensor(x) -> bool:
    """x is a PyTorch tensor (PyTorch loaded only where one can exist)."""
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)  # (None while another thread imports it)
    return tensor is not None and isinstance(x, tensor)


def to_numpy_all(x):
    """x's arrays, in tuples (named ones too) at any depth, as NumPy arrays; scalars as they are."""
    if isinstance(x, tuple):
        parts = [to_numpy_all(v) for v in x]
        return type(x)(*parts) if hasattr(x, "_fields") else tuple(parts)
    return x if isinstance(x, (float, int)) or x is None else to_numpy(x)


def float64(x):
    """x as float64 in its own namespace (NumPy for anything that is not another's array)."""
    if not _is_tensor(x):
        return np.asarray(x, dtype=np.float64)
    return x if x.dtype == _torch().float64 else x.to(_torch().float64)


def like(x, a):
    """a (a NumPy array: a mask, a bias row; or already x's kind: as it is) on x's namespace and
    device."""
    if isinstance(x, np.ndarray) or (_is_tensor(a) and a.device == x.device):
        return a
    if _is_tensor(a):
        return a.to(x.device)
    a = _torch().as_tensor(np.array(a))  # (a copy: the mask may be read-only)
    if x.device.type != "cuda":
        return a.to(x.device)
    # From page-locked memory without waiting: a copy that waits would wait for every kernel queued
    # before it (PyTorch keeps the page-locked block until the copy is done).
    return a.pin_memory().to(x.device, non_blocking=True)


def namespace(*xs):
    """The array namespace of xs: NumPy for NumPy arrays and scalars, else array_api_compat's."""
    if all(isinstance(x, (np.ndarray, np.generic, float, int)) for x in xs):
        return np
    from array_api_compat import array_namespace  # noqa: PLC0415 -- only off the NumPy path
    return array_namespace(*[x for x in xs if not isinstance(x, (float, int))])


def put(x, value, where):
    """x with `value` where `where` is true: in place for NumPy (x a fresh array of the caller's),
    a new array for another namespace (the array API has no masked assignment)."""
    if isinstance(x, np.ndarray):
        np.copyto(x, value, where=where)
        return x
    return namespace(x).where(where, value, x)


def zeros(x, shape):
    """float64 zeros of `shape` on x's namespace and device."""
    if isinstance(x, np.ndarray):
        return np.zeros(shape)
    return _torch().zeros(shape, dtype=_torch().float64, device=x.device)


def add_product(out, A, B):
    """out + A @ B, into out (an array of the caller's own): on a device in the GEMM itself
    (addmm: the product is never stored apart)."""
    if isinstance(out, np.ndarray):
        out += A @ B
        return out
    return out.addmm_(A, B)


def add_scaled(out, x, a: float):
    """out + a·x, into out (out and x arrays of the caller's own: x is overwritten on NumPy)."""
    if isinstance(out, np.ndarray):
        x *= a
        out += x
        return out
    return out.add_(x, alpha=a)


def add_magnitude(out, x):
    """out + |x|, into out (an array of the caller's own)."""
    if isinstance(out, np.ndarray):
        out += np.abs(x)
        return out
    return out.add_(x.abs())


def clip(x, low: Optional[float] = None, high: Optional[float] = None):
    """x limited to [low, high] (either may be None), by Python floats: on a device no copy of the
    bound is made there (a copy from the host waits for every kernel queued before it)."""
    if not _is_tensor(x):
        return np.clip(x, low, high)
    return _torch().clamp(x, low, high)


def isfinite(x):
    """Where x is finite (NumPy's isfinite). PyTorch's isfinite is four kernels, each a pass over
    x (x == x, |x|, != inf, and their product); |x| <= the format's largest finite value is two,
    and false for NaN as for ±inf."""
    if not _is_tensor(x):
        return np.isfinite(x)
    torch = _torch()
    if not x.dtype.is_floating_point:
        return torch.ones_like(x, dtype=torch.bool)
    return torch.abs(x) <= torch.finfo(x.dtype).max


def binade_sq(x):
    """4^e for each x in ±[2^e, 2^(e+1)) of a float64 tensor (0 for 0 and subnormals): its bits
    with the sign and mantissa cleared, squared (verify/model/rounding.py's binade_sq, which
    NumPy's arrays take)."""
    torch = _torch()
    x = x.contiguous().to(torch.float64)
    out = (x.view(torch.int64) & 0x7FF0000000000000).view(torch.float64)
    return out * out


def sort_rows_with_columns(x):
    """(x's rows sorted, the column each sorted element came from), for float32 x, by one sort of
    64-bit keys (each element's bits, made to sort as the floats do, above its column), where a sort
    and an argsort would each pass over x: equal values in column order. −0 sorts just before +0,
    and NaN by its bits (first or last), where NumPy's and PyTorch's sorts put it last."""
    if str(x.dtype) not in ("float32", "torch.float32"):
        raise TypeError(f"sort_rows_with_columns sorts float32, not {x.dtype}")
    if isinstance(x, np.ndarray):
        keys = ordered_bits(np.ascontiguousarray(x).view(np.int32)).astype(np.int64) << 32
        keys |= np.arange(x.shape[-1], dtype=np.int64)
        keys.sort(axis=-1)
        columns = keys & 0xFFFFFFFF
        return np.take_along_axis(x, columns, axis=-1), columns
    torch = _torch()
    keys = ordered_bits(x.contiguous().view(torch.int32)).to(torch.int64) << 32
    keys |= torch.arange(x.shape[-1], dtype=torch.int64, device=x.device)
    keys = torch.sort(keys, dim=-1).values
    columns = keys & 0xFFFFFFFF
    return torch.take_along_dim(x, columns, dim=-1), columns


def ordered_bits(bits):
    """float32 values' bits (as int32) made to order as the floats do: negatives' magnitude bits
    flipped (−0 just below +0, NaN by its bits), in either namespace."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def take_along_rows(x, columns):
    """x's elements at the given columns of each row (NumPy's take_along_axis on axis 1)."""
    if isinstance(x, np.ndarray):
        return np.take_along_axis(x, columns, axis=1)
    return _torch().take_along_dim(x, columns, dim=1)


def segment_sums(labels, weights, n: int):
    """The sums of weights by label (n labels 0 … n − 1; NumPy's bincount)."""
    if isinstance(weights, np.ndarray):
        return np.bincount(labels, weights=weights, minlength=n)
    out = _torch().zeros(n, dtype=weights.dtype, device=weights.device)
    return out.index_add_(0, labels, weights)


def running_max(x):
    """The running maximum along each row (NumPy's maximum.accumulate on axis 1)."""
    if isinstance(x, np.ndarray):
        return np.maximum.accumulate(x, axis=1)
    return _torch().cummax(x, dim=1).values


def quiet(xp):
    """Floating-point warnings off within the block (NumPy's; PyTorch raises none)."""
    return np.errstate(all="ignore") if xp is np else contextlib.nullcontext()


def concat_rows(parts):
    """The parts stacked along the rows, in their namespace."""
    xp = namespace(*parts)
    return xp.concat(parts, axis=0) if xp is not np else np.concatenate(parts, axis=0)


__all__ = ["DEVICES", "DeviceError", "cuda_visible", "resolve_device", "device_argument", "device_jobs", "on_device",
           "target", "visible_gpus", "gpu_memory_bytes", "to_device", "to_numpy", "to_numpy_all", "float64", "like",
           "put", "zeros", "clip", "add_product", "add_scaled", "add_magnitude", "binade_sq", "namespace", "quiet",
           "concat_rows", "to_numpy_later", "ordered_bits", "sort_rows_with_columns", "take_along_rows", "running_max",
           "segment_sums", "isfinite"]
