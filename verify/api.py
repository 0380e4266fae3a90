"""The Python API: check attention stages held in arrays (PyTorch, Triton, CuPy, ctypes code).

    import attnstep
    report = attnstep.check_arrays(q, k, v, {"output": o, "flash_lse": lse}, causal=True)
    assert attnstep.check_arrays(q, k, v, {"output": o})        # a report is true when every stage passes
    attnstep.assert_attention_stages(q, k, v, {"output": o})   # in a pytest test: the report in the message
    attnstep.check_arrays(q, k, v, {"dQ": q.grad, "dK": k.grad, "dV": v.grad}, do=o.grad)  # backward
    attnstep.check_arrays(q, k, v, {"output": out}, layout="bshd", causal="bottom-right",  # flash-attn
                          window=(256, 0), softcap=30.0, alibi=slopes)
    attnstep.check_arrays(q, k, v, {"output": out}, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,  # varlen
                          causal="bottom-right")

Arrays are NumPy arrays, anything np.asarray takes, or PyTorch tensors (CPU or CUDA, bf16 and fp16 included;
verify/files/arrays.py converts them), shaped (N, d) for one head, (H, N, d) or (B, H, N, d) (layout="bhsd",
PyTorch's) or (B, N, H, d) (layout="bshd", flash-attn's); k and v with fewer heads than q are grouped K/V heads
(GQA/MQA). Each stage has the same leading axes and the stage's own last two (an N×1 stage may drop its last
axis); scores and row statistics are (B, H, ...) in either layout. Packed sequences (flash-attn's
flash_attn_varlen_func): with cu_seqlens_q, cu_seqlens_k (and seqused_k) q, k, v and the per-token stages are
(total, heads, dim), layout="thd", lse and D (heads, total); each sequence is checked as a case of its own. The
report is the one `attnstep check` prints and writes: the same tolerance model, chained and isolated references,
diagnoses.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from .api_arguments import expect_report, validated
from .check import flash_attn_criterion as fa_criterion
from .check.compare import Options, Report, check_run
from .check.paged import cache_after_checks, diagnose_paged, name_declared_layout, split_combine
from .check.row_order import name_transposed_rows
from .diagnose.hypotheses import diagnose
from .files.arrays import as_array, bias_heads, dims_of, mask_heads, slopes_rows, stage_heads
from .files.case import InputCase, validate_dims
from .files.kinds import CaseError
from .files.cache_layouts import NHD
from .files.kv_cache import kv_cache
from .files.kv_step import packed_keys, step_splits, step_stages
from .files.packed_arrays import packed_layout, packing
from .files.outputs import RunInfo, StageSource, half_rounding_for
from .files.split_files import split_arguments, split_run
from .model.half import rounding_refusal
from .report.text import failure_lines, header_lines, summary_lines, table_lines
from .stages import (ALIBI_SLOPES_INPUT, BIAS_INPUT, DIM_KEYS, DROPOUT_MASK, GRAD_INPUT, INPUT_NAMES, KV_HEADS_KEY,
                     MASK_INPUT, STAGES, Dims, default_scale)
from .variant import BOTTOM_RIGHT, BROADCAST, NONE, PER_HEAD, TOP_LEFT, Variant

ARRAYS = Path("<arrays>")  # what the report names as the run's and the inputs' place


def _problem(q, k, v, do, layout: str, allow_nonfinite: bool) -> Tuple[Dims, Dict[str, np.ndarray], Optional[str]]:
    """The case's dimensions from q, k, v in `layout` (k and v may have fewer heads: GQA), the
    inputs as (heads, rows, cols), and a note when the layout looks like the other one."""
    arrays = {name: as_array(x, arg) for name, arg, x in zip(INPUT_NAMES, ("q", "k", "v"), (q, k, v))}
    if do is not None:
        arrays[GRAD_INPUT] = as_array(do, "do")
    (B, H, Hk, N, M, d_k, d_v), note = dims_of(*(arrays[n] for n in INPUT_NAMES), layout)
    try:
        dims = validate_dims({**dict(zip(DIM_KEYS, (B, H, N, M, d_k, d_v))), KV_HEADS_KEY: Hk}, "q, k, v")
    except CaseError as exc:
        raise ValueError(str(exc)) from None
    heads = {n: stage_heads(arrays[n], n, dims, layout, n.lower()) for n in arrays}
    bad = [n for n in heads if not allow_nonfinite and not np.isfinite(heads[n]).all()]
    if bad:
        raise ValueError(f"{bad[0].lower()} holds NaN or Inf; pass allow_nonfinite=True to check a kernel on such "
                         "inputs (NaN then passes where the reference has NaN)")
    return dims, heads, note


def _variant(args: Dict[str, Any], attn_mask, attn_bias, dims: Dims) -> Tuple[Variant, Dict[str, np.ndarray]]:
    """The Variant the arguments ask for, and the mask, bias and slopes arrays the case holds."""
    causal, align = args["causal"], args["align"]
    aligned = causal if isinstance(causal, str) else None
    if aligned and align and aligned != align:
        raise ValueError(f"causal={causal!r} with align={align!r}: choose one alignment")
    tensors: Dict[str, np.ndarray] = {}
    coverage = {}
    for name, given, read in ((MASK_INPUT, attn_mask, mask_heads), (BIAS_INPUT, attn_bias, bias_heads)):
        if given is None:
            coverage[name] = NONE
            continue
        tensors[name], broadcast = read(given, dims)
        coverage[name] = BROADCAST if broadcast else PER_HEAD
    alibi = args["alibi"]
    if alibi is not False and alibi is not True:
        tensors[ALIBI_SLOPES_INPUT] = slopes_rows(alibi, dims)
    try:
        variant = Variant(causal=bool(causal), align=aligned or align or TOP_LEFT, window=args["window"],
                          softcap=args["softcap"], alibi=alibi is not False, mask=coverage[MASK_INPUT],
                          bias=coverage[BIAS_INPUT], dropout=args["dropout_p"])
    except ValueError as exc:  # each argument is valid: causal and the window's right side clash
        raise ValueError(f"causal with window: {exc}") from None
    return variant, tensors


def _stage_sources(stages: Mapping[str, object], dims: Dims, layout: str, dropout: float,
                   packed: bool = False) -> Dict[str, StageSource]:
    unknown = [n for n in stages if n not in STAGES]
    if unknown:
        raise ValueError(f"unknown stage {unknown[0]!r}; stages are: {', '.join(STAGES)}")
    if not stages:
        raise ValueError("no stage to check: pass at least one of " + ", ".join(STAGES))
    masks = [n for n in stages if STAGES[n].dropout]
    if masks and not dropout:
        raise ValueError(f"stage {masks[0]!r} is a dropout keep-mask: pass dropout_p= (the probability the program "
                         "used)")
    if dropout and not masks:
        raise ValueError(f"dropout_p={dropout}: pass the program's keep-mask too, as stages[{DROPOUT_MASK!r}] (1 kept, "
                         "0 dropped): the outputs are checked against the entries it kept")
    return {name: StageSource(name, None, name, arrays=stage_heads(stages[name], name, dims, layout, packed=packed))
            for name in STAGES if name in stages}


def check_arrays(q, k, v, stages: Mapping[str, object], *, do=None, causal=False, align: Optional[str] = None,
                 window: Optional[Tuple[int, int]] = None, softcap: Optional[float] = None, alibi=False,
                 attn_mask=None, attn_bias=None, dropout_p: float = 0.0, layout: Optional[str] = None,
                 scale: Optional[float] = None, precision: str = "fp32", math: str = "ieee",
                 atol: Optional[float] = None, rtol: Optional[float] = None, jobs: int = 1,
                 allow_nonfinite: bool = False, half_rounding: Optional[str] = None, cu_seqlens_q=None,
                 cu_seqlens_k=None, seqused_k=None, split_output=None, split_lse=None, split_size=None,
                 device: str = "auto") -> Report:
    """Checks each stage in `stages` ({stage name: array}) computed from q, k, v, as `attnstep
    check` does; returns the Report (report.passed, report.first_failing_stage, report.results),
    whose truth value is report.passed: `assert check_arrays(...)` fails when a stage fails
    (assert_attention_stages also puts the report in the message).

    do: the output gradient dL/d(output), shaped like the output, for the backward stages (dQ, dK,
    dV, D, dP, dS, flash_dQ, ...). The variant (docs/contract.md): causal: False, True (top-left: PyTorch's
    is_causal) or "top-left"/"bottom-right" (flash-attn's causal=True); align: the diagonal's alignment for a
    window or ALiBi without causal; window: (left, right), -1 unbounded (flash-attn's window_size); softcap:
    C·tanh(S/C) after the scale; alibi: True (the standard slopes) or the slopes, (H,) or (B, H); attn_mask:
    True/1 visible, (N, M), (B, H, N, M) or broadcastable to it (PyTorch's boolean attn_mask; a float one is
    attn_bias); attn_bias: added to the scores (−inf hides); dropout_p: with the program's keep-mask in stages.
    layout: "bhsd" (the default) or "bshd" (flash-attn's (batch, seq, heads, dim)), or "thd" (packed).
    cu_seqlens_q, cu_seqlens_k: packed sequences (flash-attn's varlen convention, B + 1 offsets each, ints, a
    NumPy array or a tensor), seqused_k: the keys each uses; q, k, v, do and the per-token stages are then
    (total, heads, dim) (layout "thd", the default then), lse and D (heads, total), and each sequence is checked
    as a case of its own (the causal mask, the window and ALiBi within it). scale: default 1/sqrt(d_k);
    precision and math: the arithmetic the program used (fp32/tf32/bf16/fp16; ieee/fast); half_rounding: how a
    bf16/fp16 program converts to its format ("nearest", the default, or "toward-zero"; half precisions only).
    At fp32 or tf32 a stage of half-precision values (a float16 array; a bf16 tensor, converted to float32) gets
    a note, and a hint in the failure line, to pass precision='bf16' or 'fp16'. split_output, split_lse,
    split_size: a split-KV program's splits in flash-attn's layouts (out_accum, lse_accum; docs/check.md), each
    checked on its own, flash_output and flash_lse against their combine. device: where the flash stages'
    float64 references run, as check's --device ("auto": "cuda" where PyTorch sees a GPU, else "cpu"). Raises
    ValueError for arrays that do not fit together (a layout that does not fit is named) or a value out of
    range, TypeError for an argument of the wrong kind (causal="no", scale="0.25"), each one line naming the
    argument."""
    args = validated(stages=stages, causal=causal, align=align, window=window, softcap=softcap, alibi=alibi,
                      dropout_p=dropout_p, layout=layout, scale=scale, precision=precision, math=math, atol=atol,
                      rtol=rtol, jobs=jobs, allow_nonfinite=allow_nonfinite, half_rounding=half_rounding, device=device)
    offsets = (cu_seqlens_q, cu_seqlens_k, seqused_k)
    args["splits"] = split_arguments(split_output, split_lse, split_size, stages)
    report = check_run(*_opened(q, k, v, stages, do, args, attn_mask, attn_bias, offsets), diagnoser=diagnose)

    def passes(alone: Dict[str, np.ndarray]) -> bool:
        return bool(check_run(*_opened(q, k, v, alone, do, dict(args, splits=None), attn_mask, attn_bias, offsets)))
    if not report:
        name_transposed_rows(report, stages, passes)
    return report


def _opened(q, k, v, stages, do, args: Dict[str, Any], attn_mask, attn_bias,
            offsets) -> Tuple[RunInfo, InputCase, Options]:
    """The run, the input case and the options that check_arrays' validated arguments describe."""
    refusal = rounding_refusal(args["precision"], args["half_rounding"], "half_rounding")
    if refusal:
        raise ValueError(refusal)
    backward = sorted(n for n in stages if n in STAGES and STAGES[n].backward)
    if backward and do is None:
        raise ValueError(f"stage {backward[0]!r} is a gradient: pass do= (the output gradient it was computed from)")
    seqs = packing(args, *offsets)
    layout = args["layout"]
    if seqs is not None:
        layout = packed_layout(seqs, stages, attn_mask, attn_bias, args["dropout_p"], {"q": q, "k": k, "v": v, "do": do})
    dims, inputs, note = _problem(q, k, v, do, layout, args["allow_nonfinite"])
    note = None if seqs is not None else note  # (the tokens checked against the offsets: no doubt left)
    variant, tensors = _variant(args, attn_mask, attn_bias, dims)
    sources = _stage_sources(stages, dims, layout, variant.dropout, seqs is not None) \
        if stages or not args.get("splits") else {}
    scale = default_scale(dims.d_k) if args["scale"] is None else args["scale"]
    case = InputCase(ARRAYS, dims, "npy", scale=scale, manifest=True, arrays={**inputs, **tensors},
                     allow_nonfinite=args["allow_nonfinite"], backward=do is not None, variant=variant, sequences=seqs)
    run_dims, sources = split_run(args.get("splits"), dims, seqs, variant.dropout, sources)
    run = RunInfo(None, {}, run_dims, sources, scale=scale, precision=args["precision"], math=args["math"],
                  half_rounding=half_rounding_for(args["precision"], args["half_rounding"]), variant=variant)
    if note:
        run.notes.append(note)
    options = Options(atol=args["atol"], rtol=args["rtol"], jobs=args["jobs"], allow_nonfinite=args["allow_nonfinite"],
                      device=args.get("device", "cpu"))
    return run, case, options


def check_kvcache(q, k_cache, v_cache, stages: Mapping[str, object], *, cache_seqlens, block_table=None,
                  k_new=None, v_new=None, causal=False, window: Optional[Tuple[int, int]] = None,
                  softcap: Optional[float] = None, alibi=False, scale: Optional[float] = None, precision: str = "fp32",
                  math: str = "ieee", atol: Optional[float] = None, rtol: Optional[float] = None, jobs: int = 1,
                  allow_nonfinite: bool = False, half_rounding: Optional[str] = None, k_cache_after=None,
                  v_cache_after=None, split_output=None, split_lse=None, split_size=None,
                  cache_layout: str = NHD) -> Report:
    """Checks a decode step against a KV cache, as flash-attn's flash_attn_with_kvcache or vLLM's
    paged attention computes it; returns the Report, true when every stage (and the cache after
    the step) passes.

    q: (batch, queries, heads, dim), the queries aligned bottom-right (speculative decoding), or (batch, heads,
    dim), one query a sequence (vLLM's; the stages then drop the queries' axis too); k_cache, v_cache: (batch,
    max_seqlen, kv_heads, dim), or pages (num_blocks, page_size, kv_heads, dim) with block_table (batch,
    max_blocks_per_seq) (any page size >= 1); cache_layout: "nhd" (those, flash-attn's), "hnd" (FlashInfer's:
    (num_blocks, kv_heads, page_size, dim), dense (batch, kv_heads, max_seqlen, dim)) or "vllm" (vLLM's
    paged_attention kernels': keys (num_blocks, kv_heads, dim / x, block_size, x), values (num_blocks, kv_heads,
    dim, block_size); paged only), the cache after the step in the same; cache_seqlens: the keys each sequence holds
    before the step (an int or (batch,)); k_new, v_new: (batch, new keys, kv_heads, dim) or (batch, kv_heads, dim),
    written at cache_seqlens[b] before the attention (flash-attn's k and v). stages: output or flash_output (batch,
    queries, heads, dim) and flash_lse (batch, heads, queries). causal=True and window are flash-attn's
    (bottom-right); softcap, alibi ((H,) slopes), scale, precision, math, atol, rtol, jobs, allow_nonfinite,
    half_rounding as check_arrays'.
    k_cache_after, v_cache_after: the cache after the step, checked exactly (the new keys written through the table,
    every other slot unchanged). split_output, split_lse, split_size: a flash-decoding step's splits of split_size
    keys each, out_accum (num_splits, batch, heads, queries, dim) and lse_accum (num_splits, batch, heads, queries),
    each checked on its own and the flash stages against their combine (stages may be {}: the splits alone, a paging
    bug then named from their combine); with cache_layout="vllm", paged_attention_v2's partitions: tmp_out
    (num_seqs, num_heads, max_num_partitions, head_size) and max_logits + log(exp_sums). Each sequence's keys are
    gathered and every sequence checked as a packed case; a failing one is explained by the paged bugs' diagnoses
    (paged_*, cache_length_off_by_one, new_keys_unseen, cache_layout_misread; a correct step given in another layout
    than cache_layout says: cache_layout_declared; a cache after: cache_* in its `diagnosis`). A ValueError or
    TypeError names the argument and what is wrong."""
    args = validated(stages=stages, causal=causal, align=None, window=window, softcap=softcap, alibi=alibi,
                      dropout_p=0.0, layout=None, scale=scale, precision=precision, math=math, atol=atol, rtol=rtol,
                      jobs=jobs, allow_nonfinite=allow_nonfinite, half_rounding=half_rounding,
                      cache_layout=cache_layout)
    splits = split_arguments(split_output, split_lse, split_size, stages)
    arrays = (q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new)
    kv = kv_cache(*arrays, args["cache_layout"])
    aligned = isinstance(args["causal"], str)
    args.update(causal=BOTTOM_RIGHT if args["causal"] is True else args["causal"],
                align=None if aligned else BOTTOM_RIGHT)
    report = _decode_step(kv, args, splits, diagnose)

    def read_as(layout):
        try:
            return kv_cache(*arrays, layout.name)
        except (ValueError, TypeError):
            return None
    flash = step_stages(kv, args["stages"]) or split_combine(step_splits(kv, splits))
    name_declared_layout(report, kv, flash, read_as, lambda other: bool(_decode_step(other, args, splits, None)))
    report.run_checks += cache_after_checks(kv, k_cache_after, v_cache_after)
    return report


def _decode_step(kv, args: Dict[str, Any], splits, diagnoser) -> Report:
    """check_kvcache's report of the step read from kv (its cache after aside); with a diagnoser,
    the failures diagnosed and the paged readings searched."""
    packed = step_stages(kv, args["stages"])

    def recheck(q, k, v, stages, seqs, diagnoser=None, splits=None) -> Report:
        # (a reading's re-check is of the step's own stages: the splits are the whole step's)
        run, case, options = _opened(q, k, v, stages, None, dict(args, splits=splits), None, None,
                                     (seqs.cu_q, seqs.cu_k, None))
        case.sequences = seqs  # (the packing the check gathered from the cache, known as such)
        return check_run(run, case, options, diagnoser=diagnoser)

    keys, packed_splits = packed_keys(kv, [kv.gather(b) for b in range(kv.batch)]), step_splits(kv, splits)
    report = recheck(kv.q.reshape((-1,) + kv.q.shape[2:]), *keys, packed,
                     kv.sequences([kv.m(b) for b in range(kv.batch)]), diagnoser, packed_splits)
    if diagnoser is not None:
        diagnose_paged(report, kv, packed or split_combine(packed_splits), recheck)
    return report


def format_report(report: Report, per_head: bool = False) -> str:
    """The report as `attnstep check` prints it."""
    report, per_head = expect_report(report), validated(per_head=per_head)["per_head"]
    return "\n".join(header_lines(report) + table_lines(report, per_head) + failure_lines(report)
                     + summary_lines(report) + fa_criterion.text_lines(report))


def flash_attn_criterion(report: Report) -> List[fa_criterion.StageCriterion]:
    """flash-attn's test criterion for a half-precision report (precision="bf16"/"fp16"), per stage
    its tests compare (output, flash_output, dQ, dK, dV, flash_dQ, ...): .error and .baseline_error
    (the largest |error| of your values and of an eager half-precision attention against the
    reference rounded to the format), .ratio, .allowed, .meets. Empty for fp32/tf32. Informational:
    report.passed is attnstep's verdict."""
    return fa_criterion.stage_criteria(expect_report(report))


def assert_attention_stages(q, k, v, stages: Mapping[str, object], **kwargs) -> Report:
    """check_arrays, raising AssertionError with the stage table when a stage fails (for pytest)."""
    report = check_arrays(q, k, v, stages, **kwargs)
    if not report.passed:
        raise AssertionError("attention stages differ from the float64 reference:\n" + format_report(report))
    return report
