"""Input cases on disk: Q (and the output gradient dO) per query head, K and V per K/V head (text
or .npy), the variant's mask, bias and slopes files, an optional manifest, the layout checked.

The matrix files and manifests are read by verify/files/matrix_io.py and verify/files/manifests.py (their
names are re-exported here, where most callers look for them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..sequences import NEW_KEY_INPUTS, NEW_KEYS_KEY, PAGE_SIZE_KEY, Sequences
from ..stages import (ALIBI_SLOPES_INPUT, CASE_INPUTS, FORMATS, GRAD_INPUT, INPUT_MANIFEST, INPUT_NAMES, KV_HEADS_KEY,
                      STAGES, VARIANT_INPUTS, Dims, parse_stage_file, stage_file)
from ..text import plural, printable
from ..variant import BROADCAST, NONE, PER_HEAD, Variant, alibi_slopes, with_causal
from .kinds import CaseError
from .manifests import (INPUT_KEYS, INT64, build_variant, check_case_limits, check_scale, check_types, read_toml,
                        validate_dims, variant_fields, write_toml)
from .matrix_io import (atomic_write_bytes, crc32_hex, file_kind, matrix_bytes, matrix_max_bytes, output_file_target,
                        parse_matrix, parse_npy_matrix, parse_text_matrix, probe_writable, read_bytes, read_matrix,
                        text_header_fields, write_matrix)
from .new_keys import case_new_keys, new_key_file_names, read_new_keys, write_new_keys
from .sequence_files import case_sequences, manifest_count, sequence_file_names
from .variant_inputs import (COVERAGE_FIELD, READERS, TENSOR_INPUTS, UNUSED_SLOPES, coverage, coverage_of_files,
                             read_slopes, slope_of, whole_file, whole_files)

__all__ = ["InputCase", "load_input_case", "refuse_unused_slopes", "input_head_files", "clear_input_files",
           "replace_case_files", "CaseError", "INPUT_KEYS", "INT64", "check_scale", "check_types", "read_toml",
           "validate_dims", "write_toml", "atomic_write_bytes", "crc32_hex", "file_kind", "matrix_bytes",
           "matrix_max_bytes", "output_file_target", "parse_matrix", "parse_npy_matrix", "parse_text_matrix",
           "probe_writable", "read_bytes", "read_matrix", "text_header_fields", "write_matrix"]

# ----------------------------------------------------------------------------------------------
# Input cases.

@dataclass
class InputCase:
    """An input case. `causal` mirrors variant.causal (it predates variants; both are set from
    either when the case is made). The heads' matrices are read when asked for (load,
    variant_input), so a check holds one head's at a time."""
    path: Path
    dims: Dims
    fmt: str
    causal: bool = False
    scale: Optional[float] = None  # None: 1/sqrt(d_k)
    manifest: bool = False         # the case has a manifest (which then says causal and scale)
    # The Python API's arrays: Q and dO (B·H, N, d), K and V (B·Hk, M, d); mask and bias as
    # (B, H, N, M) (broadcast views), alibi_slopes (1 or B, H).
    arrays: Optional[Dict[str, np.ndarray]] = None
    allow_nonfinite: bool = False  # NaN/inf in Q/K/V load instead of being an error
    backward: bool = False         # the case has dO for every head (the backward stages exist)
    variant: Optional[Variant] = None  # what the case asks for; None: textbook attention (causal as said)
    # A packed case: its sequences (verify/sequences.py); None: no packing.
    sequences: Optional[Sequences] = None
    # The files read once for every head (a broadcast mask or bias, the slopes), read-only.
    _whole: Dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        self.variant = with_causal(self.variant, self.causal)
        self.causal = self.variant.causal

    @property
    def inputs(self) -> Tuple[str, ...]:
        """The input matrices every head has: Q, K, V, and dO for a backward case."""
        return CASE_INPUTS if self.backward else INPUT_NAMES

    def file(self, name: str, head: int) -> Path:
        return self.path / stage_file(name, head, self.fmt)

    def load(self, name: str, head: int) -> np.ndarray:
        """The matrix `name` of `head`: a query head for Q and dO, a K/V head for K and V
        (Dims.heads_of: b·Hk + h // (H/Hk) is the one query head b·H + h reads)."""
        if self.arrays is not None:
            return self.arrays[name][head]
        pool = self.load_before(name, head)
        seqs = self.sequences
        if seqs is None or not seqs.new_keys or name not in NEW_KEY_INPUTS:
            return pool
        new = read_new_keys(self.path, self.fmt, name, head, self.dims, seqs, self.allow_nonfinite)
        return write_new_keys(pool, new, seqs)

    def load_before(self, name: str, head: int) -> np.ndarray:
        """The matrix `name` of `head` as its file holds it: K and V of a case with new keys hold the
        cache before the step (load writes the new keys in); an array case's array as given."""
        if self.arrays is not None:
            return self.arrays[name][head]
        shape = STAGES[name].shape(self.dims)
        return read_matrix(self.file(name, head), shape, allow_nonfinite=self.allow_nonfinite)

    def variant_input(self, name: str, head: int) -> Optional[np.ndarray]:
        """The N×M mask (0/1) or bias (`name`: verify/stages.py MASK_INPUT, BIAS_INPUT) of query
        head `head`, float64: its own, or the one of every head; None when the case has none."""
        cover = coverage(self.variant, name)
        if cover == NONE:
            return None
        if self.arrays is not None:
            return np.asarray(self.arrays[name][self.dims.decode_head(head)], dtype=np.float64)
        shape = tuple(self.dims.size(sym) for sym in VARIANT_INPUTS[name])
        if cover == PER_HEAD:
            return READERS[name](self.file(name, head), shape)
        if name not in self._whole:
            self._whole[name] = _read_only(READERS[name](self.path / whole_file(name, self.fmt), shape))
        return self._whole[name]

    def alibi_slope(self, head: int) -> float:
        """The ALiBi slope of flat query head `head`: from the slopes file (or array) when the case
        has one, else the standard slopes of H heads (verify/variant.py alibi_slopes)."""
        return slope_of(self._slopes(), alibi_slopes(self.dims.heads), self.dims, head)

    def _slopes(self) -> Optional[np.ndarray]:
        if self.arrays is not None:
            return self.arrays.get(ALIBI_SLOPES_INPUT)
        if ALIBI_SLOPES_INPUT not in self._whole:
            path = self.path / whole_file(ALIBI_SLOPES_INPUT, self.fmt)
            self._whole[ALIBI_SLOPES_INPUT] = _read_only(read_slopes(path, self.dims)) if path.exists() else None
        return self._whole[ALIBI_SLOPES_INPUT]


def _read_only(arr: np.ndarray) -> np.ndarray:
    """A matrix every head shares: no head's check may change it for the next."""
    arr.flags.writeable = False
    return arr


def _head_files(folder: Path) -> Dict[Tuple[str, int], List[str]]:
    """(name, head) -> the formats present, from the names <input>_head_<i>.<txt|npy> of Q, K, V,
    dO, mask and bias (head numbers without leading zeros, as the binary lists them)."""
    found: Dict[Tuple[str, int], List[str]] = {}
    for entry in sorted(os.listdir(folder)):
        parsed = parse_stage_file(entry)
        if parsed and parsed[0] in CASE_INPUTS + TENSOR_INPUTS and entry == stage_file(*parsed):
            found.setdefault((parsed[0], parsed[1]), []).append(parsed[2])
    return found


def _format_of_files(folder: Path, files) -> Optional[str]:
    """The format Q_head_0 is in (None when it is absent); both at once is ambiguous."""
    formats = files.get((INPUT_NAMES[0], 0), [])
    if len(formats) > 1:
        raise CaseError(f"{folder}: both Q_head_0.txt and Q_head_0.npy exist; HINT: remove one, or add "
                        f"format = \"txt\" (or \"npy\") to {INPUT_MANIFEST}")
    return formats[0] if formats else None


def load_input_case(folder: Path, alibi: Optional[bool] = None, page_size: Optional[int] = None) -> InputCase:
    """Reads the manifest (or infers shapes from the files) and checks the layout is complete.
    `alibi`: whether the command line turns ALiBi on or off (None: it does not say), which decides
    with the manifest whether a slopes file is used (refuse_unused_slopes); a case with neither
    leaves that to open_run, where run.toml may say. `page_size`: check's --page-size, the page
    size of a paged case without a manifest (one with a manifest must say the same)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CaseError(f"{folder}: input case folder not found; HINT: run 'attnstep generate' first")
    files, whole = _head_files(folder), whole_files(folder)
    manifest = folder / INPUT_MANIFEST
    if manifest.exists():
        case, flag = _manifest_case(folder, manifest, files, page_size)
    else:
        case, flag = _infer_case(folder, files, whole, page_size), None
    case.backward = _has_grad(case, files, flag)
    dropout = case.variant.dropout > 0
    if case.backward or dropout:  # the backward stages and the keep-mask count too, as the binary counts them
        check_case_limits(case.dims, str(manifest if manifest.exists() else folder), case.backward, dropout)
    _check_layout(case, files, flagged=flag is not None)
    _check_variant_files(case, files, whole)
    if alibi is not None or case.manifest:
        refuse_unused_slopes(case, case.variant.alibi if alibi is None else alibi)
    return case


def refuse_unused_slopes(case: InputCase, alibi: bool) -> None:
    """A slopes file in a case run or checked without ALiBi (`alibi`: the variant's, the command
    line's over the manifest's) would be ignored: an error naming it and how to turn ALiBi on, in
    the binary's words (variant_inputs.UNUSED_SLOPES)."""
    path = case.path / whole_file(ALIBI_SLOPES_INPUT, case.fmt)
    if not alibi and case.arrays is None and path.exists():
        raise CaseError(f"{path}: {UNUSED_SLOPES[0]}; HINT: {UNUSED_SLOPES[1]}")


def _manifest_case(folder: Path, manifest: Path, files, page_size: Optional[int] = None
                   ) -> Tuple[InputCase, Optional[bool]]:
    """The case its manifest describes, and its `backward` flag (None: not said)."""
    values = read_toml(manifest)
    unknown = sorted(set(values) - set(INPUT_KEYS))
    if unknown:
        raise CaseError(f"{manifest}: unknown key '{printable(unknown[0])}'")
    check_types(values, INPUT_KEYS, str(manifest))
    dims = validate_dims(values, str(manifest))
    # Without a `format` line the files say, as the binary reads it.
    fmt = values["format"] if "format" in values else _format_of_files(folder, files) or FORMATS[0]
    if fmt not in FORMATS:
        raise CaseError(f"{manifest}: format = {printable(repr(fmt))}; expected one of {', '.join(FORMATS)}")
    scale = check_scale(values["scale"], str(manifest)) if "scale" in values else None
    variant = build_variant(variant_fields(values), str(manifest))
    count = manifest_count(values, manifest)
    said = values.get(PAGE_SIZE_KEY)
    if page_size is not None and said != page_size:
        raise CaseError(f"--page-size {page_size}: {manifest} says "
                        + (f"{PAGE_SIZE_KEY} = {said}" if said is not None else f"no {PAGE_SIZE_KEY} (not paged)")
                        + "; HINT: --page-size is for a paged case without a manifest")
    sequences = case_sequences(folder, fmt, dims, variant, count, manifest=True, page_size=said,
                               backward=values.get("backward"))
    sequences = case_new_keys(folder, fmt, dims, sequences, values.get(NEW_KEYS_KEY), True, values.get("backward"))
    return (InputCase(folder, dims, fmt, scale=scale, manifest=True, variant=variant, sequences=sequences),
            values.get("backward"))


def _has_grad(case: InputCase, files, flag: Optional[bool]) -> bool:
    """Whether the case has dO: the manifest's `backward` when it says, else whether any dO file of
    the case's format exists (then every head needs one), as the binary decides."""
    grads = sorted(i for (name, i), formats in files.items() if name == GRAD_INPUT and case.fmt in formats)
    if flag is None:
        return bool(grads)
    if not flag and grads:
        raise CaseError(f"{case.file(GRAD_INPUT, grads[0])}: exists but {case.path / INPUT_MANIFEST} says "
                        "backward = false; HINT: remove the dO files, or set backward = true")
    return flag


def _heads_present(files, name: str) -> int:
    """How many heads of `name` the files hold, counting from head 0 to the first gap."""
    count = 0
    while (name, count) in files:
        count += 1
    return count


def _infer_case(folder: Path, files, whole, page_size: Optional[int] = None) -> InputCase:
    """A case without a manifest: B = 1, H from the Q files, Hk from the K files, the shapes from
    head 0's files, the mask and bias from the files present."""
    Q, K, V = INPUT_NAMES
    heads = _heads_present(files, Q)
    if heads == 0:
        raise CaseError(f"{folder}: no {stage_file(Q, 0, 'txt')} or {stage_file(Q, 0, 'npy')} and no "
                        f"{INPUT_MANIFEST}; HINT: is this an input case folder?")
    fmt = _format_of_files(folder, files)
    missing = [n for n in (K, V) if (n, 0) not in files]
    if missing:
        raise CaseError(f"{folder / stage_file(missing[0], 0, fmt)}: missing file ({stage_file(Q, 0, fmt)} exists)")
    # The K/V heads: as many as the highest K or V file says (a gap below it is a missing file).
    kv = 1 + max(i for n, i in files if n in (K, V))
    if kv > heads or heads % kv:
        raise CaseError(f"{folder}: {plural(heads, 'query head')} ({Q}_head_0..{heads - 1}) and "
                        f"{plural(kv, 'K/V head')} ({K}_head_0..{kv - 1}): the K/V heads must divide the query heads, "
                        "each serving as many; "
                        f"HINT: a missing or extra {K} or {V} file? With grouped K/V heads, write {KV_HEADS_KEY} in a "
                        f"{INPUT_MANIFEST}")
    q, k, v = (read_matrix(folder / stage_file(n, 0, fmt)) for n in INPUT_NAMES)
    if k.shape[1] != q.shape[1]:
        raise CaseError(f"{folder / stage_file(K, 0, fmt)}: {plural(k.shape[1], 'column')} but {stage_file(Q, 0, fmt)} "
                        f"has {q.shape[1]}; HINT: Q and K must share d_k")
    if v.shape[0] != k.shape[0]:
        raise CaseError(f"{folder / stage_file(V, 0, fmt)}: {plural(v.shape[0], 'row')} but {stage_file(K, 0, fmt)} has "
                        f"{k.shape[0]}; HINT: K and V must share seq_k")
    values = {"batch": 1, "heads": heads, "seq_q": q.shape[0], "seq_k": k.shape[0], "d_k": q.shape[1],
              "d_v": v.shape[1], KV_HEADS_KEY: kv}
    variant = Variant(**{COVERAGE_FIELD[name]: coverage_of_files(folder, name, {i for n, i in files if n == name},
                                                                 whole.get(name, set()), fmt)
                         for name in TENSOR_INPUTS})
    dims = validate_dims(values, str(folder))
    seqs = case_sequences(folder, fmt, dims, variant, None, manifest=False, page_size=page_size)
    return InputCase(folder, dims, fmt, variant=variant,
                     sequences=case_new_keys(folder, fmt, dims, seqs, None, False, None))


def _per_head_inputs(case: InputCase) -> Tuple[str, ...]:
    """The files every head has: the inputs (Q and dO per query head, K and V per K/V head), and
    the mask and the bias where the case has one per head."""
    return case.inputs + tuple(n for n in TENSOR_INPUTS if coverage(case.variant, n) == PER_HEAD)


def _heads_of(case: InputCase, name: str) -> int:
    """How many files of `name` the case has: per K/V head for K and V, else per query head."""
    return case.dims.heads_of(name) if name in STAGES else case.dims.total_heads


def _heads_in_words(case: InputCase, name: str) -> str:
    """'6 heads', or for K and V of a grouped case '2 K/V heads per batch element, 4 in all'."""
    d, count = case.dims, _heads_of(case, name)
    if name in STAGES and STAGES[name].kv and d.kv != d.heads:
        return (f"{plural(d.kv, 'K/V head')} per batch element ({KV_HEADS_KEY} = {d.kv} of {d.heads} heads), "
                f"{count} in all")
    return plural(count, "head")


def _missing(case: InputCase, name: str, head: int, flagged: bool) -> str:
    """The one-line error for a head's missing input file: 'FILE: missing file (why)', then the
    HINT where there is one."""
    hint = "; HINT: regenerate the case with 'attnstep generate --backward'" if name == GRAD_INPUT else ""
    return f"{case.file(name, head)}: missing file ({_why_required(case, name, flagged)}){hint}"


def _why_required(case: InputCase, name: str, flagged: bool) -> str:
    if name == GRAD_INPUT:
        return "the manifest says backward = true" if flagged else "the case has dO files, so every head needs one"
    if name in TENSOR_INPUTS:
        return (f'{INPUT_MANIFEST} says {COVERAGE_FIELD[name]} = "{PER_HEAD}": one file per query head' if case.manifest
                else f"the case has {name} files, so every head needs one")
    return f"{_heads_in_words(case, name)} expected"


def _check_layout(case: InputCase, files, flagged: bool) -> None:
    """Every head's inputs in the case's format; no head beyond the case; no file of the other
    format (which one would be meant?), as the binary checks. `flagged`: the manifest says
    `backward` (which then is why dO is required)."""
    names = _per_head_inputs(case)
    for i in range(case.dims.total_heads):
        for name in names:
            if i < _heads_of(case, name) and case.fmt not in files.get((name, i), ()):
                raise CaseError(_missing(case, name, i, flagged))
    for (name, i), formats in sorted(files.items(), key=lambda kv: kv[0][::-1]):
        other = [f for f in formats if f != case.fmt]
        if other:
            raise CaseError(f"{case.path / stage_file(name, i, other[0])}: a .{other[0]} file in a .{case.fmt} "
                            "case; HINT: a case holds one format; remove the stray file")
        if name in names and i >= _heads_of(case, name):
            count = _heads_of(case, name)
            raise CaseError(f"{case.path / stage_file(name, i, formats[0])}: unexpected file: the case has "
                            f"{_heads_in_words(case, name)} (0..{count - 1})")


def _check_variant_files(case: InputCase, files, whole) -> None:
    """The mask and bias files as the case covers its heads with them (none, per head, one for
    all), and the ALiBi slopes, read now (a small file) where they will be used."""
    def says(name: str) -> str:
        return f'{case.path / INPUT_MANIFEST} says {COVERAGE_FIELD[name]} = "{coverage(case.variant, name)}"'
    for name in TENSOR_INPUTS:
        cover = coverage(case.variant, name)
        heads = sorted(i for n, i in files if n == name)
        if heads and cover != PER_HEAD:
            raise CaseError(f"{case.file(name, heads[0])}: a {name} per head, but {says(name)}; HINT: remove the "
                            f'{name}_head files, or set {COVERAGE_FIELD[name]} = "{PER_HEAD}"')
        _refuse_other_format(case, name, whole)
        path = case.path / whole_file(name, case.fmt)
        if name in whole and cover != BROADCAST:
            raise CaseError(f"{path}: one {name} for every head, but {says(name)}; HINT: remove it, or set "
                            f'{COVERAGE_FIELD[name]} = "{BROADCAST}"')
        if cover == BROADCAST and name not in whole:
            raise CaseError(f"{path}: missing file ({says(name)}: one {name} for every head)")
    _refuse_other_format(case, ALIBI_SLOPES_INPUT, whole)
    if ALIBI_SLOPES_INPUT in whole:
        case.alibi_slope(0)  # reads and checks the file, used or not (refuse_unused_slopes), as the binary does


def _refuse_other_format(case: InputCase, name: str, whole) -> None:
    other = sorted(whole.get(name, set()) - {case.fmt})
    if other:
        raise CaseError(f"{case.path / whole_file(name, other[0])}: a .{other[0]} file in a .{case.fmt} case; HINT: a "
                        "case holds one format; remove the stray file")


def input_head_files(folder: Path) -> List[str]:
    """The names of the input files in `folder`: Q, K, V, dO, mask and bias per head, the mask,
    bias and slopes files of every head, and the sequence and new-key files of a packed case."""
    per_head = [stage_file(name, i, fmt) for (name, i), formats in _head_files(folder).items() for fmt in formats]
    return (per_head + [whole_file(name, fmt) for name, fmts in whole_files(folder).items() for fmt in sorted(fmts)]
            + sequence_file_names(folder) + new_key_file_names(folder))


def clear_input_files(folder: Path) -> None:
    """Removes an earlier case's input head files and manifest, so no stale head survives."""
    for name in input_head_files(folder):
        (folder / name).unlink()
    (folder / INPUT_MANIFEST).unlink(missing_ok=True)


def replace_case_files(staging: Path, out_dir: Path, names: List[str]) -> None:
    """The files staged in `staging` (the manifest and `names`) over the earlier case's in out_dir,
    the manifest first: a generate stopped midway (even by SIGKILL, which no cleanup sees) leaves a
    manifest whose files are not all there, which the binary and `check` refuse, never a folder of
    fewer heads that reads as a whole case without a manifest. Stopped by anything Python sees, it
    clears what it moved: no case at all."""
    clear_input_files(out_dir)
    try:
        for name in [INPUT_MANIFEST] + names:
            os.replace(staging / name, out_dir / name)
    except BaseException:
        clear_input_files(out_dir)
        raise
