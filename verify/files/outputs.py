"""Output cases: where a run's stage matrices are, and what the run claims to have computed.

Two forms are checked. The project's binary writes the strong one: `run.toml` (run id, backend,
precision, shapes, a CRC-32 per file) beside `<stage>_head_{i}.txt|npy`. Anyone else's program
writes what it writes: no run.toml (or part of one), any subset of the stages, text printed with
any precision, one `<stage>.npy` holding every head, or files named its own way (a name map).
Shapes then come from the input case, the stages are the files present, staleness checks are off
(with a note), and the arithmetic assumed is that of any correct IEEE float32 implementation.

The variant (causal masking, its alignment, the window, softcap, ALiBi, dropout) and the scale
follow the input case (what the user asked for) unless the command line overrides them; a
run.toml that says otherwise is a mismatch the report fails on. The stages of K/V heads (K, V,
dK, dV, ...) have one file per K/V head: B·Hk of them in a grouped-query case.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

from ..model.half import HALF_ROUNDINGS, NEAREST, rounding_refusal  # noqa: F401 (cli's choices)
from ..model.kernels import KERNELS, kernel_base_name
from ..sequences import SEQUENCES_KEY, Sequences
from ..stages import (DIM_KEYS, FORMATS, KV_HEADS_KEY, MAX_DIM, PRECISIONS, RUN_MANIFEST, SPLIT_SIZE_KEY, STAGES, Dims,
                      default_scale, parse_stage_file, per_sequence, stage_file)
from ..text import plural, printable
from ..variant import VARIANT_KEYS, Variant, with_causal
from .case import InputCase, check_scale, check_types, crc32_hex, read_toml, refuse_unused_slopes, validate_dims
from .manifests import CAUSAL_KEY, build_variant, variant_fields
from .kinds import CaseError
from .run_settings import Mismatch, resolve_variant
from .split_files import SplitSource, refuse_split_variants, run_split_size, split_dims, split_sources
from .stage_files import (STACKED_SUFFIX, STAGE_ITEMSIZE, StageSource, check_heads_named, discover_sources,
                          files_past_the_heads, named_alike, parse_name_map, pattern_regex, read_names_file,
                          refuse_query_head_kv_files)
from .unfinished import refuse_unfinished

__all__ = ["RunInfo", "Overrides", "Mismatch", "open_run", "load_run", "read_run_manifest", "stage_files_in",
           "foreign_stage_files", "staleness", "StageSource", "STAGE_ITEMSIZE", "parse_name_map",
           "read_names_file", "MATH_MODES", "BACKENDS"]

BACKENDS = ("cpu", "cuda")          # what the project's binary writes as run.toml's `backend`
MATH_MODES = ("ieee", "fast")       # strict IEEE float32, or CUDA's fast-math intrinsics
TILE_KEYS = ("flash_block_q", "flash_block_k")  # the flash kernel's tile: Br query rows, Bc keys
TIMING_PREFIX = "time_ms_"           # run.toml's per-stage timings: time_ms_<stage> = milliseconds
RUN_KEY_TYPES = {**{k: int for k in DIM_KEYS}, KV_HEADS_KEY: int, SEQUENCES_KEY: int, "run_id": str, "backend": str, "device": str,
                 "precision": str, "format": str, "stages": str, CAUSAL_KEY: bool, **VARIANT_KEYS, "scale": float,
                 **{k: int for k in TILE_KEYS}, "flash_kernel": str, "poison": bool, SPLIT_SIZE_KEY: int}


# ----------------------------------------------------------------------------------------------
# The run: its stages, settings and claims.

@dataclass(frozen=True)
class Overrides:
    """What the user said on the command line (None: not said). variant: the Variant fields said
    (verify/variant.py; `causal` may be said either way)."""
    causal: Optional[bool] = None
    scale: Optional[float] = None
    precision: Optional[str] = None
    math: str = "ieee"
    names: Mapping[str, str] = field(default_factory=dict)
    half_rounding: Optional[str] = None
    variant: Mapping[str, object] = field(default_factory=dict)
    split_size: Optional[int] = None  # check --split-size: the keys per split of a run that splits

    def variant_fields(self) -> Dict[str, object]:
        return {**({"causal": self.causal} if self.causal is not None else {}), **self.variant}


@dataclass
class RunInfo:
    path: Optional[Path]
    values: dict                     # run.toml as read; {} without one
    dims: Dims
    sources: Dict[str, StageSource]  # stage -> its matrices, table order
    causal: bool = False
    scale: float = 1.0
    precision: str = "fp32"
    backend: Optional[str] = None    # None: not the project's binary
    math: str = "ieee"
    half_rounding: str = NEAREST     # how a bf16/fp16 program converts to its format
    verify_crc: bool = False
    notes: List[str] = field(default_factory=list)
    mismatches: List[Mismatch] = field(default_factory=list)
    variant: Optional[Variant] = None  # what the run is checked against; `causal` mirrors its causal
    sequences: Optional[Sequences] = None  # a packed case's packing (its N×M stages are per sequence)

    def __post_init__(self):
        self.variant = with_causal(self.variant, self.causal)
        self.causal = self.variant.causal

    @property
    def stages(self) -> Tuple[str, ...]:
        return tuple(self.sources)

    # run_id and device are only ever shown: printable() where they enter messages and reports.
    @property
    def run_id(self) -> Optional[str]:
        v = self.values.get("run_id")
        return None if v is None else printable(v)

    @property
    def device(self) -> Optional[str]:
        v = self.values.get("device")
        return None if v is None else printable(v)

    @property
    def lists_stages(self) -> bool:
        """Whether run.toml lists the stages the run wrote (then every listed file must exist)."""
        return "stages" in self.values

    def crc(self, stage: str, head: int) -> Optional[str]:
        return self.values.get(f"crc32_{stage}_head_{head}")

    def file(self, stage: str, head: int) -> Path:
        return self.sources[stage].file(head, self.dims)

    @property
    def flash_tiles(self) -> Optional[Tuple[int, int]]:
        br, bc = (self.values.get(k) for k in TILE_KEYS)
        return (int(br), int(bc)) if br and bc else None

    @property
    def flash_kernel(self) -> Optional[str]:
        v = self.values.get("flash_kernel")
        return str(v) if v else None

    def timings(self) -> Dict[str, float]:
        return {k[len(TIMING_PREFIX):]: float(v) for k, v in self.values.items() if k.startswith(TIMING_PREFIX)}

    def read(self, stage: str, head: int):
        return self.sources[stage].read(head, self.dims)


def read_run_manifest(folder: Path) -> dict:
    """run.toml's values, type-checked ({} when there is none)."""
    manifest = Path(folder) / RUN_MANIFEST
    if not manifest.exists():
        return {}
    values = read_toml(manifest)
    check_types(values, RUN_KEY_TYPES, str(manifest))
    check_types(values, {k: float for k in values if k.startswith(TIMING_PREFIX)}, str(manifest))
    if "scale" in values:
        check_scale(values["scale"], str(manifest))
    if "precision" in values and values["precision"] not in PRECISIONS:
        raise CaseError(f"{manifest}: precision = {printable(repr(values['precision']))}; expected one of "
                        f"{', '.join(PRECISIONS)}")
    if "backend" in values and values["backend"] not in BACKENDS:
        raise CaseError(f"{manifest}: backend = {printable(repr(values['backend']))}; expected one of {', '.join(BACKENDS)} "
                        "(leave it out for a program other than attnstep's binary)")
    kernel = values.get("flash_kernel")
    if kernel and kernel_base_name(kernel) not in KERNELS:
        raise CaseError(f"{manifest}: flash_kernel = {printable(repr(kernel))}; expected one of {', '.join(KERNELS)} "
                        "(with -split<K> when split), or none")
    if kernel and "backend" in values and not kernel.startswith(values["backend"]):
        raise CaseError(f"{manifest}: flash_kernel = {printable(repr(kernel))} with backend = {printable(repr(values['backend']))}: the "
                        f"{values['backend']} backend has no such kernel")
    for key in TILE_KEYS:  # (0: no flash stage ran)
        if key in values and not 0 <= values[key] <= MAX_DIM:
            raise CaseError(f"{manifest}: {key} = {values[key]}: a flash tile of 0..{MAX_DIM} (0: no flash stage ran)")
    if "format" in values and values["format"] not in FORMATS:
        raise CaseError(f"{manifest}: format = {printable(repr(values['format']))}; expected one of {', '.join(FORMATS)}")
    build_variant(variant_fields(values), str(manifest))  # each variant key valid, in one line
    return values


def _listed_sources(folder: Path, values: dict, names: Mapping[str, str]) -> Dict[str, StageSource]:
    """The stages run.toml lists, in its format (names mapped where the user said so)."""
    manifest = folder / RUN_MANIFEST
    listed = tuple(s for s in str(values["stages"]).split(",") if s)
    unknown = [s for s in listed if s not in STAGES]
    if unknown:
        raise CaseError(f"{manifest}: unknown stage '{printable(unknown[0])}' in 'stages'")
    if not listed:
        raise CaseError(f"{manifest}: 'stages' is empty: nothing to check")
    fmt = values.get("format", FORMATS[0])
    return {s: StageSource(s, folder, names.get(s) or _listed_pattern(folder, s, fmt)) for s in STAGES if s in listed}


def _listed_pattern(folder: Path, stage: str, fmt: str) -> str:
    """A listed stage's files: per head in run.toml's format, or one `<stage>.npy` where that is
    what the folder holds."""
    per_head = stage_file(stage, 0, fmt)
    stacked = stage + STACKED_SUFFIX
    if not (folder / per_head).exists() and (folder / stacked).exists():
        return stacked
    return per_head.replace("_head_0.", "_head_{i}.")


def _run_dims(values: dict, case: InputCase, folder: Path, packing: bool = True) -> Dims:
    given = [k for k in DIM_KEYS if k in values]
    manifest = folder / RUN_MANIFEST
    for key in given:
        if values[key] != getattr(case.dims, key):
            raise CaseError(f"{manifest}: {key} = {values[key]} but the input case {case.path} has "
                            f"{key} = {getattr(case.dims, key)}; HINT: the output was computed from another "
                            "input case: run it again")
    kv = values.get(KV_HEADS_KEY)
    if kv is not None and kv != case.dims.kv:  # (0 is no count of K/V heads: the binary writes dims.kv)
        raise CaseError(f"{manifest}: {KV_HEADS_KEY} = {kv} but the input case {case.path} has "
                        f"{plural(case.dims.kv, 'K/V head')} per batch element; HINT: the output was computed from "
                        "another input case: run it again")
    if packing:
        _check_sequences(values, case, manifest)
    return case.dims


def _check_sequences(values: dict, case: InputCase, manifest: Path) -> None:
    """run.toml's `sequences` (the binary writes it for a packed case, and only then) against the
    input case's packing: another count, or a packing one side lacks, is another case's run. A
    run.toml without `backend` (another program's) may leave the key out."""
    count = values.get(SEQUENCES_KEY)
    have = None if case.sequences is None else case.sequences.count
    if count is None and (have is None or "backend" not in values):
        return
    if count == have:
        return
    ran = f"{SEQUENCES_KEY} = {count}" if count is not None else f"no {SEQUENCES_KEY} (not packed)"
    asked = plural(have, "packed sequence") if have is not None else "no packing"
    raise CaseError(f"{manifest}: {ran} but the input case {case.path} has {asked}; HINT: the output was "
                    "computed from another input case: run it again")


def _settings(run: RunInfo, case: InputCase, values: dict, over: Overrides) -> None:
    """The variant (resolve_variant) and the scale: the command line, else the input case (its
    manifest), else run.toml, else the defaults; run.toml disagreeing with an input case that says
    is a mismatch."""
    run.variant, mismatches = resolve_variant(case, values, over.variant_fields(), run.path)
    run.causal = run.variant.causal
    run.mismatches.extend(mismatches)
    asked_scale = (case.scale if case.scale is not None else default_scale(case.dims.d_k)) if case.manifest \
        else case.scale
    run.scale = float(next(v for v in (over.scale, asked_scale, values.get("scale"),
                                       default_scale(case.dims.d_k)) if v is not None))
    if over.scale is None and asked_scale is not None and "scale" in values \
            and np.float32(values["scale"]) != np.float32(asked_scale):
        run.mismatches.append(Mismatch("scale", float(values["scale"]), asked_scale))
    run.precision = over.precision or values.get("precision", PRECISIONS[0])
    run.backend = values.get("backend")
    run.math = over.math
    run.half_rounding = half_rounding_for(run.precision, over.half_rounding)


def half_rounding_for(precision: str, asked: Optional[str]) -> str:
    """The conversion rounding the bounds assume: the one asked for (a half precision only), else
    to nearest."""
    refusal = rounding_refusal(precision, asked, "--half-rounding")
    if refusal:
        raise CaseError(refusal)
    return asked or NEAREST


def open_run(folder: Path, case: InputCase, over: Overrides = Overrides(), packing: bool = True) -> RunInfo:
    """The output case in `folder`, read against the input case it was computed from (packing:
    whether `case` says its packing; load_run's, made from run.toml alone, cannot)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CaseError(f"{folder}: output case folder not found; HINT: run 'attnstep run' first")
    refuse_unfinished(folder)
    values = read_run_manifest(folder)
    dims = _run_dims(values, case, folder, packing)
    unmatched: List[str] = []
    if "stages" in values:
        sources = _listed_sources(folder, values, over.names)
    else:
        sources = discover_sources(folder, over.names, unmatched)
    max_keys = dims.seq_k if case.sequences is None or not packing else \
        max((case.sequences.m(b) for b in range(case.sequences.count)), default=0)
    dims = split_dims(dims, run_split_size(values, over.split_size, folder), max_keys)
    split_notes: List[str] = []
    sources = split_sources(folder, sources, dims, "stages" in values, over.names, split_notes)
    check_heads_named({s: StageSource(s, folder, over.names[s]) for s in unmatched}, dims)  # (a wrong pattern first)
    unnamed = [f"the name map's {s}={printable(over.names[s])}" for s in unmatched]
    if not sources and unnamed:
        alike = [n for s in unmatched for n in named_alike(folder, over.names[s])]
        case_words = f"; named alike but for case: {', '.join(alike)} (names are case-sensitive)" if alike else ""
        raise CaseError(f"{folder}: no file matches {', '.join(unnamed)}; nothing would be checked; HINT: the "
                        "pattern is a file name in the output folder, {i} the head's number ({j} the K/V head's)"
                        + case_words)
    if not sources:
        raise CaseError(f"{folder}: no stage files (<stage>_head_<i>.txt or .npy, or <stage>.npy, "
                        f"stages {', '.join(STAGES)}); HINT: is this the folder your program writes? "
                        "Name other files with --name STAGE=PATTERN")
    check_heads_named(sources, dims)
    refuse_query_head_kv_files(sources, dims)
    run = RunInfo(folder, values, dims, sources, sequences=case.sequences)
    run.verify_crc = any(k.startswith("crc32_") for k in values) or "run_id" in values
    _settings(run, case, values, over)
    refuse_unused_slopes(case, run.variant.alibi)  # (run.toml may be what turned ALiBi on)
    _refuse_dropout_stages(run)
    refuse_split_variants(run.dims, run.stages, run.variant.dropout, str(folder))
    if not values:  # (a run.toml without keys, an empty one included, says as little as none)
        said = f"{RUN_MANIFEST} without keys" if (folder / RUN_MANIFEST).exists() else f"no {RUN_MANIFEST}"
        run.notes.append(f"{said}: shapes from the input case, stages from the files present, "
                         "files not checked for staleness, any correct IEEE float32 arithmetic accepted"
                         + (f" (values stored in {run.precision})" if run.precision in ("bf16", "fp16") else ""))
    elif not run.verify_crc:
        run.notes.append(f"{RUN_MANIFEST} has no CRC-32 table: files not checked for staleness")
    run.notes += [f"{n}: no file in {printable(str(folder))} matches it: not checked" for n in unnamed]
    run.notes += split_notes
    past = [] if "stages" in values else files_past_the_heads(folder, sources, dims)
    if past:
        run.notes.append(f"{plural(len(past), 'stage file')} for heads the input case does not have "
                         f"({dims.total_heads} query heads) ignored, e.g. {printable(past[0])}: is --in the case "
                         "the program ran on?")
    return run


def _refuse_dropout_stages(run: RunInfo) -> None:
    """A stage that exists only with dropout (the keep-mask) in a run checked without it."""
    dropped = [s for s in run.stages if STAGES[s].dropout]
    if dropped and not run.variant.dropout:
        raise CaseError(f"{run.path or 'the run'}: holds {dropped[0]} (a dropout keep-mask) but the case has no "
                        "dropout; HINT: check with --dropout P (the probability the program used), or leave the "
                        "mask out")


def load_run(folder: Path) -> RunInfo:
    """A run of the project's binary read on its own (its run.toml names shapes and stages)."""
    folder = Path(folder)
    manifest = folder / RUN_MANIFEST
    if not manifest.exists():
        raise CaseError(f"{manifest}: missing: the binary's run did not finish, or {folder} is not an "
                        "output case; HINT: run 'attnstep run' again")
    values = read_run_manifest(folder)
    dims = validate_dims(values, str(manifest))
    case = InputCase(folder, dims, values.get("format", FORMATS[0]), scale=values.get("scale"), manifest=True,
                     variant=build_variant(variant_fields(values), str(manifest)))
    return open_run(folder, case, packing=False)


def stage_files_in(folder: Path, names: Mapping[str, str] = {}) -> List[str]:
    """Every file name in `folder` that a run could have written: stage files, run.toml, and the
    files a name map's patterns match (any head)."""
    mapped = [pattern_regex(p) for p in names.values() if "/" not in p]
    out = []
    for entry in sorted(os.listdir(folder)):
        parsed = parse_stage_file(entry)
        if (parsed and parsed[0] in STAGES) or entry == RUN_MANIFEST or \
                (entry.endswith(STACKED_SUFFIX) and entry[:-len(STACKED_SUFFIX)] in STAGES) or \
                any(m.fullmatch(entry) for m in mapped):
            out.append(entry)
    return out


def foreign_stage_files(run: RunInfo) -> List[str]:
    """Stage files in the output folder that the run's manifest does not list (leftovers)."""
    if run.path is None or not run.lists_stages:
        return []
    listed = {name for s in run.stages for name in run_file_names(run, s)}
    listed |= {src.pattern for src in run.sources.values()}
    return [e for e in stage_files_in(run.path) if e not in listed and e != RUN_MANIFEST]


def run_file_names(run: RunInfo, stage: str) -> List[str]:
    """The files a run of `stage` holds: one per head; in a packed case, an N×M stage named the
    binary's way has one per head and sequence that has queries and keys instead."""
    src, heads = run.sources[stage], range(run.dims.heads_of(stage))
    if isinstance(src, SplitSource):
        return src.file_names(run.dims)
    seqs = run.sequences
    if seqs is None or not per_sequence(stage) or src.arrays is not None or not src.per_head:
        return [src.name(i, run.dims) for i in heads]
    fmt = src.pattern.rpartition(".")[2]
    return [stage_file(stage, i, fmt, seq=b) for i in heads for b in range(seqs.count) if seqs.n(b) and seqs.m(b)]


def staleness(run: RunInfo, stage: str, head: int, data: Optional[bytes]) -> Optional[str]:
    """Why a file is not from this run (its CRC-32 differs or is not listed), or None."""
    if not run.verify_crc or data is None:
        return None
    name = run.sources[stage].name(head, run.dims)
    want = run.crc(stage, head)
    if want is None:
        return f"{name} is not listed in {RUN_MANIFEST}'s CRC table: not from run {run.run_id}"
    if crc32_hex(data) != str(want):
        hdr = _header_run(data)
        origin = f" (its header says run {hdr})" if hdr and hdr != run.run_id else ""
        return (f"{name} was not written by run {run.run_id}{origin}: its CRC-32 differs from "
                f"{RUN_MANIFEST} (a file from an earlier run, or edited since)")
    return None


_HEADER_RUN = re.compile(rb"^# attnstep[^\n]*\brun=(\S+)")


def _header_run(data: bytes) -> Optional[str]:
    m = _HEADER_RUN.match(data[:512])
    return printable(m.group(1).decode("ascii", "replace")) if m else None
