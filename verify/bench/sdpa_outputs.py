"""PyTorch's scaled_dot_product_attention run on an input case, its results written as another
program's output folder: PyTorch's SDPA backends (flash, memory-efficient, cuDNN, math) are
independent, correct bf16/fp16 attention kernels, so `attnstep check --precision` must pass each, on
every variant of attention the backend takes.

    python -m verify.cli.sdpa_outputs --in data/random_test --out data/sdpa_flash --backend flash --precision bf16
    attnstep check --in data/random_test --out data/sdpa_flash --precision bf16

The inputs and the files: verify/bench/foreign_outputs.py (the case's Q, K, V, dO in the format, as
the verifier rounds them; one `<stage>.npy` per stage, every head). One backend runs, forced with
torch.nn.attention.sdpa_kernel; the gradients come from autograd with the case's dO. The fused
backends are FlashAttention-style kernels (scores and softmax in float32, P rounded to the format
before P·V, the log-sum-exp kept), so their results are the flash stages (flash_output, flash_lse,
flash_dQ, flash_dK, flash_dV); the math backend composes matmul and softmax, so its results are the
stage path's output, dQ, dK, dV (`math`: torch's default, float32 inside; `math-half`: with torch's
fp16/bf16 reductions, each op's result in the format). No run.toml: `check` assumes any correct
program of the precision it is given, and reads the variant from the case's manifest.

The variant (verify/variant.py) as SDPA takes it:
* Grouped K/V heads (GQA/MQA): enable_gqa=True with K and V of Hk heads; autograd's dK and dV then
  have Hk heads, each its group's sum, and are written so.
* A causal mask alone: torch's is_causal, top-left aligned (query i sees keys j <= i; its documented
  mask is torch.ones(N, M).tril()) as the contract's top-left. Aligned bottom-right with N != M, the
  flash backend runs its own operator (torch.ops.aten._scaled_dot_product_flash_attention) with its
  causal flag, which aligns bottom-right as flash-attn does (torch.nn.attention.bias.causal_lower_right
  relies on that), K and V repeated over each group (the operator takes no GQA; autograd sums dK and
  dV back); the other backends take that mask as an attn_mask. `--mask explicit`: an attn_mask always.
* Anything else that hides keys (a window, either alignment; a mask file): a boolean attn_mask (True
  keeps) from verify.variant.hidden. ALiBi or a bias file: a float attn_mask, what
  verify.variant.modified_scores adds to the scores, -inf where hidden. The fused backends take a
  float mask in the query's format (the memory-efficient kernel refuses another), so it is rounded
  to it; a note says when that changed a value (ALiBi's standard slopes of 2^k heads times distances
  below 256 are exact in bf16).
* Softcap and dropout: SDPA has neither that the check can follow (no tanh of the scores; its dropout's
  keep-mask is not returned): reported as unavailable. FlexAttention runs softcap
  (verify/bench/flex_outputs.py).
A backend that refuses the problem (torch's flash backend takes no attn_mask; some take no GQA, or
not at every size) is reported as unavailable, with torch's reason.

A packed case: SDPA run once per sequence, on its query rows and the keys it reads (a paged case's
gathered through its block table, as PyTorch users check a paged decode kernel: SDPA on the gathered
cache), its results written back at the sequence's packed rows (verify/bench/sequence_outputs.py).

The log-sum-exp: SDPA does not return it, so it comes from the backend's own operator
(torch.ops.aten._scaled_dot_product_{flash,efficient,cudnn}_attention, run once more on the same
inputs, K and V repeated over each group, the mask as a float bias); none for the math backend, or
where the operator refuses.

On the CPU (device "cpu", torch's CPU build: the CPU tests) the math and flash backends run; the
flash backend's lse comes from its CPU operator (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu),
whose causal flag aligns top-left, so a bottom-right causal mask is an attn_mask there.

torch is imported only when SDPA runs: the package, and everything here but run_sdpa, imports and
works without it. The command that runs it on a case: verify/cli/sdpa_outputs.py.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..model.half import round_to_format
from ..stages import GRAD_INPUT, HALF_PRECISIONS, INPUT_NAMES
from ..variant import TOP_LEFT, UNBOUNDED, hidden, modified_scores
from .foreign_outputs import (GRADS, BackendUnavailable, CaseTensors, Results, load_case_tensors, stage_arrays,
                              write_stage_files)
from .sdpa import rejection_reason, torch_dtype
from .sequence_outputs import packed_results


@dataclass(frozen=True)
class Backend:
    sdp: str                 # torch.nn.attention.SDPBackend's name
    fused: bool              # a FlashAttention-style kernel: its results are the flash stages, lse too
    half_math: bool = False  # torch's fp16/bf16 reductions allowed in the math backend


# The math backend computes in float32 and rounds its results (torch's default since 2.5); math-half
# allows its fp16/bf16 reductions (torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp), so each
# of its ops (Q and K scaled by √scale, Q·Kᵀ, softmax, P·V, and the backward's) rounds its result
# to the format, as eager half-precision code does.
FLASH = "flash"
BACKENDS = {FLASH: Backend("FLASH_ATTENTION", True), "efficient": Backend("EFFICIENT_ATTENTION", True),
            "cudnn": Backend("CUDNN_ATTENTION", True), "math": Backend("MATH", False),
            "math-half": Backend("MATH", False, half_math=True)}
# A causal mask alone: the backend's own causal flag (NATIVE), or an attn_mask (EXPLICIT).
NATIVE, EXPLICIT = "is_causal", "explicit"
MASKS = (NATIVE, EXPLICIT)
# The formats SDPA computes in here (fp32: the fused backends' exponentials may be the GPU's
# approximate ones; check such a run with --math fast).
SDPA_PRECISIONS = ("fp32",) + HALF_PRECISIONS
DEVICES = ("cuda", "cpu")


@dataclass
class SdpaCall:
    """What scaled_dot_product_attention is given, built without torch (sdpa_call)."""
    inputs: Dict[str, np.ndarray]            # Q, dO (B, H, ·, ·); K, V (B, Hk, M, ·)
    scale: float
    is_causal: bool = False                  # torch's is_causal: top-left
    bottom_right: bool = False               # the flash operator's own causal flag: bottom-right
    attn_mask: Optional[np.ndarray] = None   # bool (True keeps) or float64 (added), (B|1, H|1, N, M)
    enable_gqa: bool = False
    notes: List[str] = field(default_factory=list)
    device: str = "cuda"                     # where torch runs it: "cuda", or "cpu" (torch's CPU kernels)


# A function (call, backend, precision) -> Results: run_sdpa, or a stand-in that computes without
# torch (the CPU tests).
Runner = Callable[[SdpaCall, str, str], Results]
# A change to the case's tensors before the run (the tests plant bugs so).
Plant = Callable[[CaseTensors], CaseTensors]


# ----------------------------------------------------------------------------------------------
# What SDPA is given (no torch).

def sdpa_refusal(t: CaseTensors) -> Optional[str]:
    """Why SDPA cannot compute the case's variant at all (any backend), or None."""
    if t.variant.softcap > 0:
        return "SDPA has no softcap (C·tanh of the scores); FlexAttention has (--backend flex)"
    if t.variant.dropout > 0:
        return "SDPA does not return its dropout keep-mask, which the check needs"
    return None


def _causal_alone(t: CaseTensors) -> bool:
    """A causal mask with nothing else hiding keys or changing scores."""
    v = t.variant
    return v.causal and v.left == UNBOUNDED and t.mask is None and not v.modifies_scores


def score_terms(t: CaseTensors) -> Optional[np.ndarray]:
    """What ALiBi and the bias file add to each head's scores, (B, H, N, M) float64: modified_scores
    of zero scores (the variant's softcap aside, which SDPA cannot apply); None without either."""
    v = t.variant
    if not v.alibi and t.bias is None:
        return None
    batch, heads, n, m = t.shape
    plain, zeros = v.with_(softcap=0.0), np.zeros((n, m))
    bias = None if t.bias is None else np.broadcast_to(t.bias, t.shape)
    out = np.empty(t.shape)
    for b in range(batch):
        for h in range(heads):
            out[b, h] = modified_scores(zeros, plain, t.slopes[b, h] if v.alibi else 0.0,
                                        None if bias is None else bias[b, h])
    return out


def attention_mask(t: CaseTensors) -> Optional[np.ndarray]:
    """The case's mask and score terms as one attn_mask: boolean (True keeps) when the variant only
    hides keys, float (score_terms, -inf where hidden) when it adds to the scores, None when
    neither; (B, H, N, M), or (1, 1, N, M) when it is the same for every head."""
    _, _, n, m = t.shape
    if t.mask is None:
        hide = hidden(t.variant, n, m)[None, None]
    else:
        hide = np.stack([hidden(t.variant, n, m, head) for head in t.mask.reshape(-1, n, m)]).reshape(t.mask.shape)
    added = score_terms(t)
    if added is None:
        return ~hide if hide.any() else None
    return np.where(hide, -np.inf, added)


def _rounding_note(mask: np.ndarray, precision: str) -> Optional[str]:
    """What rounding a float attn_mask to the format changes, or None when nothing."""
    finite = mask[np.isfinite(mask)]
    moved = np.abs(round_to_format(finite, precision) - finite)
    changed = int(np.count_nonzero(moved))
    if not changed:
        return None
    return (f"the float attn_mask rounded to {precision} for the kernel (it takes it in the query's format): "
            f"{changed} of its {finite.size} finite values changed, by up to {moved.max():.3g}")


def sdpa_call(t: CaseTensors, backend: str, precision: str, mask: str = NATIVE, device: str = "cuda") -> SdpaCall:
    """What SDPA is given for the case (module doc); BackendUnavailable when SDPA has no way to
    compute its variant. A dense case: a packed one is given sequence by sequence
    (sequence_outputs.sequence_tensors)."""
    refusal = sdpa_refusal(t)
    if refusal:
        raise BackendUnavailable(f"{backend}: {refusal}")
    call = SdpaCall(t.inputs, t.scale, enable_gqa=t.grouped, device=device)
    _, _, n, m = t.shape
    if mask == NATIVE and _causal_alone(t):
        if t.variant.align == TOP_LEFT or n == m:
            call.is_causal = True
            return call
        if backend == FLASH and device == "cuda":  # the CPU flash operator's flag is top-left
            call.bottom_right = True
            return call
        call.notes.append("the bottom-right causal mask passed as an attn_mask (torch's is_causal is top-left)")
    call.attn_mask = attention_mask(t)
    if (call.attn_mask is not None and call.attn_mask.dtype != bool and BACKENDS[backend].fused
            and precision in HALF_PRECISIONS):
        note = _rounding_note(call.attn_mask, precision)
        call.notes += [note] if note else []
    return call


def write_sdpa_case(in_dir: Path, out_dir: Path, backend: str, precision: str, mask: str = NATIVE,
                    scale: Optional[float] = None, runner: Optional[Runner] = None,
                    plant: Optional[Plant] = None, device: str = "cuda") -> Results:
    """Runs SDPA (`runner`, default run_sdpa) on the case IN and writes its results into OUT as
    stage files; a packed or paged case sequence by sequence (module doc). scale: the case's unless
    given (a wrong one shows that the check fails it); plant: a change to the case's tensors first
    (a planted bug; `sequences=None` drops the packing: attention across the sequences);
    device: where torch runs ("cpu": torch's CPU kernels)."""
    if backend not in BACKENDS or precision not in SDPA_PRECISIONS or mask not in MASKS or device not in DEVICES:
        raise ValueError(f"backend {backend!r}, precision {precision!r}, mask {mask!r}, device {device!r}: expected "
                         f"one of {', '.join(BACKENDS)}; {', '.join(SDPA_PRECISIONS)}; {', '.join(MASKS)}; "
                         f"{', '.join(DEVICES)}")
    tensors = load_case_tensors(in_dir, precision, scale)
    if plant is not None:
        tensors = plant(tensors)
    run = runner or run_sdpa

    def dense(t: CaseTensors) -> Results:
        call = sdpa_call(t, backend, precision, mask, device)
        results = run(call, backend, precision)
        results.notes[:0] = call.notes
        return results

    results = dense(tensors) if tensors.sequences is None else packed_results(tensors, dense)
    write_stage_files(out_dir, stage_arrays(results, BACKENDS[backend].fused), precision, in_dir)
    return results


# ----------------------------------------------------------------------------------------------
# SDPA on the GPU, or torch's CPU kernels (torch imported here only).

def cuda_torch(device: str = "cuda"):
    """torch, where it is installed and (device "cuda") sees a CUDA device; else
    BackendUnavailable saying which."""
    try:
        import torch  # noqa: PLC0415 (optional dependency)
    except ImportError:
        raise BackendUnavailable("PyTorch is not installed") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailable(f"torch {torch.__version__} sees no CUDA device")
    return torch


def _refused(call: Callable[[], object], backend: str):
    """call() under the forced backend; torch's refusal (its warnings say why the kernel was not
    used, then "No available kernel"), a keyword this torch lacks, or a kernel's failure becomes
    BackendUnavailable, with the reason bench reports for a refused backend (sdpa.rejection_reason)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return call()
        except (RuntimeError, TypeError) as exc:
            why = rejection_reason([str(w.message) for w in caught], str(exc) or type(exc).__name__)
            raise BackendUnavailable(f"{backend}: {why}") from None


def to_numpy(x) -> np.ndarray:
    return x.detach().float().cpu().numpy()


def repeat_kv(q, k, v):
    """K and V repeated over the query heads of each group (for operators that take no GQA)."""
    group = q.shape[1] // k.shape[1]
    return (k, v) if group == 1 else (k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))


def _float_bias(torch, mask_t, q, m: int):
    """The attn_mask as the operators' float bias of the query's dtype, (B, H, N, M), its rows
    padded to a multiple of 16 columns (the memory-efficient kernel's alignment) and cut back."""
    if mask_t is None:
        return None
    if mask_t.dtype == torch.bool:
        mask_t = torch.zeros(mask_t.shape, dtype=q.dtype, device=q.device).masked_fill(~mask_t, float("-inf"))
    batch, heads, n = q.shape[:3]
    padded = torch.zeros(batch, heads, n, -(-m // 16) * 16, dtype=q.dtype, device=q.device)
    padded[..., :m] = mask_t.to(q.dtype)
    return padded[..., :m]


def _lse(torch, backend: str, q, k, v, call: SdpaCall, mask_t) -> np.ndarray:
    """The backend's log-sum-exp (natural log, float32) of each query row, from its own operator:
    flash's is (B, H, N), the memory-efficient one's padded to a multiple of 32 rows, cuDNN's
    (B, H, N, 1); each cut to (B, H, N)."""
    aten, scale, causal = torch.ops.aten, call.scale, call.is_causal
    k, v = repeat_kv(q, k, v)
    bias = _float_bias(torch, mask_t, q, k.shape[2])
    if call.device == "cpu":
        if backend != FLASH:
            raise RuntimeError(f"no {backend} operator on the CPU")
        ops = {FLASH: lambda: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                                 scale=scale)}
    else:
        ops = {"flash": lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale),
               "efficient": lambda: aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal,
                                                                                 scale=scale),
               "cudnn": lambda: aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, causal, False,
                                                                         scale=scale)}
    with torch.no_grad():
        lse = ops[backend]()[1]
    batch, heads, n = q.shape[:3]
    return to_numpy(lse.reshape(batch, heads, -1)[..., :n])


def _flash_bottom_right(torch, q, k, v, scale: float):
    """(output, lse) of the flash operator with its own causal flag, aligned bottom-right."""
    k, v = repeat_kv(q, k, v)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[:2]
    return out, lse


def run_sdpa(call: SdpaCall, backend: str, precision: str) -> Results:
    """SDPA of the call's inputs ((B, heads, rows, cols) float32 arrays holding values of the format)
    on the call's device, at the format, under `backend` alone; the gradients too when dO is given."""
    torch = cuda_torch(call.device)
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415
    except ImportError:
        raise BackendUnavailable(f"torch {torch.__version__} cannot force an SDPA backend "
                                 "(no torch.nn.attention)") from None
    from torch.nn.functional import scaled_dot_product_attention  # noqa: PLC0415

    dtype = torch_dtype(torch, precision)
    dev = call.device
    q, k, v = (torch.from_numpy(np.ascontiguousarray(call.inputs[n])).to(dev).to(dtype).requires_grad_()
               for n in INPUT_NAMES)
    mask_t = None if call.attn_mask is None else torch.from_numpy(np.ascontiguousarray(call.attn_mask)).to(dev)
    if mask_t is not None and mask_t.dtype != torch.bool:  # the fused kernels take the query's format
        mask_t = mask_t.to(dtype if BACKENDS[backend].fused else torch.float32)
    gqa = {"enable_gqa": True} if call.enable_gqa else {}

    def forward():
        if call.bottom_right:
            return _flash_bottom_right(torch, q, k, v, call.scale)
        return scaled_dot_product_attention(q, k, v, attn_mask=mask_t, is_causal=call.is_causal, scale=call.scale,
                                            **gqa), None

    with sdpa_kernel(getattr(SDPBackend, BACKENDS[backend].sdp)), _math_reductions(torch, BACKENDS[backend]):
        out, lse = _refused(forward, backend)
        results = Results(to_numpy(out))
        grad_output = call.inputs.get(GRAD_INPUT)  # the case's dO, when it has one
        if grad_output is not None:
            do = torch.from_numpy(np.ascontiguousarray(grad_output)).to(dev).to(dtype)
            results.grads = dict(zip(GRADS, map(to_numpy, _refused(lambda: torch.autograd.grad(out, (q, k, v), do),
                                                                    backend))))
    if lse is not None:
        results.lse = to_numpy(lse)
    else:
        results.lse, note = _lse_or_note(torch, backend, q, k, v, call, mask_t)
        results.notes += [note] if note else []
    return results


@contextlib.contextmanager
def _math_reductions(torch, backend: Backend):
    """torch's fp16/bf16 reductions in the math backend allowed for math-half, and the setting
    restored after."""
    if not backend.half_math:
        yield
        return
    cuda = torch.backends.cuda
    if not hasattr(cuda, "allow_fp16_bf16_reduction_math_sdp"):
        raise BackendUnavailable(f"torch {torch.__version__} has no allow_fp16_bf16_reduction_math_sdp")
    before = cuda.fp16_bf16_reduction_math_sdp_allowed()
    cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        yield
    finally:
        cuda.allow_fp16_bf16_reduction_math_sdp(before)


def _lse_or_note(torch, backend, q, k, v, call, mask_t) -> Tuple[Optional[np.ndarray], str]:
    if not BACKENDS[backend].fused:
        return None, "no flash_lse: the math backend computes no log-sum-exp"
    try:
        return _lse(torch, backend, q.detach(), k.detach(), v.detach(), call, mask_t), ""
    except (RuntimeError, TypeError) as exc:  # refused here, or another signature in this torch
        return None, f"no flash_lse: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
