"""The one table of stages, dimensions and file names on the Python side.

`cuda_src/stages.h` is its C++ twin; docs/contract.md describes both. Everything that loops over
stages, builds a file name or decodes a shape goes through this module.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple

# Dimension symbols -> manifest keys (docs/contract.md, "Dimensions").
DIM_KEYS = ("batch", "heads", "seq_q", "seq_k", "d_k", "d_v")
KV_HEADS_KEY = "kv_heads"   # optional: a case with grouped K/V heads (Dims.kv_heads)
FLASH_HEAD_DIMS = (16, 32, 64, 128)
MAX_HEAD_DIM = 256

# What the binary computes in (--precision; cuda_src/backend.h's kPrecisionNames): fp32 and tf32
# keep every value float32; bf16 and fp16 are the half pipelines (inputs and stage values in the
# format, float32 accumulation and softmax).
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
HALF_PRECISIONS = ("bf16", "fp16")
FLOAT32_PRECISIONS = ("fp32", "tf32")  # the float32 ones: what sweep times, and bench's `both`

# Case limits, the same in cuda_src/stages.h (docs/contract.md): every dimension 1..MAX_DIM,
# batch × heads at most MAX_HEADS, the elements of every stage of every head at most MAX_ELEMENTS
# (so every element and byte count fits 64 bits in the binary).
MAX_DIM = 2**24
MAX_HEADS = 2**24
MAX_ELEMENTS = 2**48
# File sizes checked against a matrix's shape before it is read: a text matrix of R×C values is at
# most TEXT_BYTES_PER_VALUE·R·C + TEXT_SLACK_BYTES bytes (room for comments); an .npy header dict
# at most NPY_MAX_HEADER_BYTES (np.load's own limit), and its data exactly R·C float32s.
TEXT_BYTES_PER_VALUE = 64
TEXT_SLACK_BYTES = 2**16
NPY_MAX_HEADER_BYTES = 10000
INPUT_MANIFEST = "manifest.toml"
RUN_MANIFEST = "run.toml"
# Inside an output folder (cuda_src/io/run_folder.h holds the same names): the marker of a run that
# has not finished, the staging folder a run writes into before it is put in place, and the
# previous run's files, moved aside.
UNFINISHED_MARKER = ".attnstep-unfinished"
STAGING_PREFIX = ".attnstep-staging-"
# Inside an input case: where `attnstep generate` writes a case before it is put in place
# (`.attnstep-generate-<pid>`).
GENERATE_STAGING_PREFIX = ".attnstep-generate-"
PREVIOUS_DIR = ".attnstep-previous"
# What `attnstep run --sanitize/--repeat` found about the program that wrote the folder.
PROGRAM_CHECKS = "program_checks.toml"
FORMATS = ("txt", "npy")
DATA_DIR = "data"
DEFAULT_CASE = "random_test"     # the classic course layout's names
DEFAULT_RESULT = "random_verify"
DEFAULT_INPUT_DIR = f"{DATA_DIR}/{DEFAULT_CASE}"
DEFAULT_OUTPUT_DIR = f"{DATA_DIR}/{DEFAULT_RESULT}"


@dataclass(frozen=True)
class Dims:
    batch: int
    heads: int
    seq_q: int
    seq_k: int
    d_k: int
    d_v: int
    # K/V heads per batch element (GQA/MQA: a divisor of heads; manifest key KV_HEADS_KEY, absent
    # in a case without grouping); 0 means one per query head. Query head h reads K/V head
    # h // (heads / kv_heads).
    kv_heads: int = 0
    # A run that splits the keys (flash-decoding): the keys per split K (0: the run does not
    # split) and the split count S (at least 1 in a run that splits: ceil(M / K), in a packed case
    # ceil(max m(b) / K)). They shape the split stages (SPLIT_STAGES) only; the case has neither.
    split_size: int = 0
    splits: int = 0

    @property
    def total_heads(self) -> int:
        return self.batch * self.heads

    @property
    def kv(self) -> int:
        """K/V heads per batch element."""
        return self.kv_heads or self.heads

    @property
    def total_kv_heads(self) -> int:
        return self.batch * self.kv

    @property
    def group_size(self) -> int:
        """Query heads per K/V head (1 without grouping)."""
        return self.heads // self.kv

    def heads_of(self, stage: str) -> int:
        """How many files of `stage` a case has: one per query head, or per K/V head."""
        return self.total_kv_heads if STAGES[stage].kv else self.total_heads

    def kv_head_of(self, head: int) -> int:
        """The flat K/V head the flat query head i = b·H + h reads: b·Hk + h // (H/Hk)."""
        b, h = divmod(head, self.heads)
        return b * self.kv + h // self.group_size

    def query_heads_of(self, kv_head: int) -> range:
        """The flat query heads that read flat K/V head `kv_head` (its group)."""
        b, g = divmod(kv_head, self.kv)
        first = b * self.heads + g * self.group_size
        return range(first, first + self.group_size)

    def size(self, sym: str) -> int:
        return {"N": self.seq_q, "M": self.seq_k, "DK": self.d_k, "DV": self.d_v, "1": 1, "S": self.splits,
                "SDV": self.splits * self.d_v}[sym]

    def with_splits(self, split_size: int, splits: int) -> "Dims":
        """These dimensions in a run that splits the keys K = split_size ways per split, S splits."""
        return replace(self, split_size=split_size, splits=splits)

    def elements_per_head(self, backward: bool = False, dropout: bool = False, kv: Optional[bool] = None) -> int:
        """The elements of every stage of one head (the case-size limit counts these; stages.h's
        elements_per_head): the backward stages only for a case with dO, the dropout stages only for
        a case with dropout. kv: only the stages indexed by K/V head (True), only the others
        (False), or every stage (None)."""
        return sum(r * c for r, c in (stage.shape(self) for stage in _TABLE
                                      if (backward or not stage.backward) and (dropout or not stage.dropout)
                                      and (kv is None or stage.kv == kv)))

    def case_elements(self, backward: bool = False, dropout: bool = False) -> int:
        """The elements of every stage of every head: the stages of the query heads once per query
        head, those indexed by K/V head once per K/V head (what MAX_ELEMENTS bounds)."""
        return (self.total_heads * self.elements_per_head(backward, dropout, kv=False)
                + self.total_kv_heads * self.elements_per_head(backward, dropout, kv=True))

    def decode_head(self, i: int) -> Tuple[int, int]:
        """Flat head index -> (batch, head); heads are batch-major."""
        return divmod(i, self.heads)

    @property
    def flash_supported(self) -> bool:
        return self.d_k == self.d_v and self.d_k in FLASH_HEAD_DIMS


@dataclass(frozen=True)
class Stage:
    name: str
    rows: str  # dimension symbol
    cols: str
    inputs: Tuple[str, ...]  # stages its isolated reference is computed from
    meaning: str
    flash: bool = False
    backward: bool = False  # exists only when the input case has the output gradient dO
    # The half pipelines (bf16, fp16): a row statistic kept float32, as FlashAttention keeps its lse
    # and D (every other stage holds values of the format; cuda_src/stages.h's kept_float32); for a
    # flash stage, the intermediates its kernel rounds to the format before a GEMM (P, dS) and reads
    # stored (the backward's flash_output).
    float32: bool = False
    rounds: Tuple[str, ...] = ()
    # Indexed by K/V head (b·Hk + h_kv, over batch × kv_heads) rather than by query head: the keys
    # and values and their gradients, which a grouped-query case (GQA/MQA) has fewer of. dK and dV
    # of a K/V head are summed over the query heads of its group.
    kv: bool = False
    # Exists only when the case has dropout (verify/variant.py): the program's keep-mask.
    dropout: bool = False
    # Exists only in a run that splits the keys (flash-decoding; Dims.split_size): one file per
    # split of the head's matrix, the split's columns (DV of them, or 1) side by side in the table's
    # shape (rows × S·DV, rows × S), as the binary holds it.
    split: bool = False

    def shape(self, dims: Dims) -> Tuple[int, int]:
        return dims.size(self.rows), dims.size(self.cols)


# Each stage's name, once: the table below and every spec, diagnosis and goal refer to these.
QUERIES, KEYS, VALUES = "Q", "K", "V"
KEYS_T = "KT"
SCORES = "QK"
SCALED_SCORES = "QK_scaled"
WEIGHTS = "attention_weights"
OUTPUT = "output"
FLASH_OUTPUT, FLASH_LSE = "flash_output", "flash_lse"
SPLIT_OUTPUT, SPLIT_LSE = "split_output", "split_lse"
DROPOUT_MASK = "dropout_mask"
GRAD_OUTPUT = "dO"
ROW_DOT = "D"
GRAD_WEIGHTS, GRAD_SCORES = "dP", "dS"
GRAD_QUERIES, GRAD_KEYS, GRAD_VALUES = "dQ", "dK", "dV"
FLASH_GRAD_QUERIES, FLASH_GRAD_KEYS, FLASH_GRAD_VALUES = "flash_dQ", "flash_dK", "flash_dV"
_FLASH_BACKWARD_SOURCES = (QUERIES, KEYS, VALUES, GRAD_OUTPUT, FLASH_OUTPUT, FLASH_LSE)
_FLASH_BACKWARD_ROUNDS = (WEIGHTS, OUTPUT, GRAD_SCORES)

_TABLE = (
    Stage(QUERIES, "N", "DK", (), "query, as the binary read it"),
    Stage(KEYS, "M", "DK", (), "key, as the binary read it", kv=True),
    Stage(VALUES, "M", "DV", (), "value, as the binary read it", kv=True),
    Stage(KEYS_T, "DK", "M", (KEYS,), "K transposed", kv=True),
    Stage(SCORES, "N", "M", (QUERIES, KEYS), "Q·Kᵀ, unscaled"),
    Stage(SCALED_SCORES, "N", "M", (SCORES,), "QK·scale, -inf where masked"),
    Stage(WEIGHTS, "N", "M", (SCALED_SCORES,), "row softmax of QK_scaled"),
    # Under dropout only: the program's keep-mask, which the stages after it read (the verifier
    # never draws its own: verify/specs/dropout.py).
    Stage(DROPOUT_MASK, "N", "M", (), "the dropout keep-mask: 1 kept, 0 dropped", dropout=True),
    Stage(OUTPUT, "N", "DV", (WEIGHTS, VALUES), "attention_weights·V (dropped and rescaled under dropout)"),
    # Under a split of the keys only (flash-decoding): each split's partial output, normalised by
    # its own sum, and its log-sum-exp, before the combine that gives flash_output and flash_lse.
    # Kept float32 at every precision (flash-attn's out_accum and lse_accum), or stored in the run's half
    # format (vLLM's partial outputs: verify/check/split_values.py).
    Stage(SPLIT_OUTPUT, "N", "SDV", (QUERIES, KEYS, VALUES), "each split's output over its keys, normalised by "
          "its own sum", flash=True, float32=True, split=True),
    Stage(SPLIT_LSE, "N", "S", (QUERIES, KEYS), "each split's log-sum-exp over its keys", flash=True,
          float32=True, split=True),
    Stage(FLASH_OUTPUT, "N", "DV", (QUERIES, KEYS, VALUES), "FlashAttention forward output", flash=True,
          rounds=(WEIGHTS,)),
    Stage(FLASH_LSE, "N", "1", (QUERIES, KEYS), "log-sum-exp of each scaled row", flash=True,
          float32=True),
    # The backward pass, from the output gradient dO (an input of the case when it has one).
    Stage(GRAD_OUTPUT, "N", "DV", (), "output gradient, as the binary read it", backward=True),
    Stage(ROW_DOT, "N", "1", (GRAD_OUTPUT, OUTPUT), "rowsum(dO∘output)", backward=True, float32=True),
    Stage(GRAD_WEIGHTS, "N", "M", (GRAD_OUTPUT, VALUES), "dO·Vᵀ", backward=True),
    Stage(GRAD_SCORES, "N", "M", (WEIGHTS, GRAD_WEIGHTS, ROW_DOT), "attention_weights∘(dP − D), 0 where masked",
          backward=True),
    Stage(GRAD_QUERIES, "N", "DK", (GRAD_SCORES, KEYS), "scale·dS·K", backward=True),
    Stage(GRAD_KEYS, "M", "DK", (GRAD_SCORES, QUERIES), "scale·dSᵀ·Q", backward=True, kv=True),
    Stage(GRAD_VALUES, "M", "DV", (WEIGHTS, GRAD_OUTPUT), "attention_weightsᵀ·dO", backward=True, kv=True),
    Stage(FLASH_GRAD_QUERIES, "N", "DK", _FLASH_BACKWARD_SOURCES,
          "FlashAttention backward dQ (P recomputed from flash_lse)", flash=True, backward=True,
          rounds=_FLASH_BACKWARD_ROUNDS),
    Stage(FLASH_GRAD_KEYS, "M", "DK", _FLASH_BACKWARD_SOURCES, "FlashAttention backward dK", flash=True,
          backward=True, rounds=_FLASH_BACKWARD_ROUNDS, kv=True),
    Stage(FLASH_GRAD_VALUES, "M", "DV", _FLASH_BACKWARD_SOURCES, "FlashAttention backward dV", flash=True,
          backward=True, rounds=_FLASH_BACKWARD_ROUNDS, kv=True),
)

STAGES: Dict[str, Stage] = {s.name: s for s in _TABLE}
STAGE_NAMES = tuple(STAGES)
INPUT_NAMES = (QUERIES, KEYS, VALUES)  # every case has these
GRAD_INPUT = GRAD_OUTPUT               # a case for the backward pass also has this
CASE_INPUTS = INPUT_NAMES + (GRAD_INPUT,)
# The forward stages of a case without dropout (what the binary writes for it); the dropout stages
# exist only in a case with dropout, the split stages only in a run that splits the keys.
FORWARD_STAGES = tuple(n for n in STAGE_NAMES if not STAGES[n].backward and not STAGES[n].dropout
                       and not STAGES[n].split)
DROPOUT_STAGES = tuple(n for n in STAGE_NAMES if STAGES[n].dropout)
SPLIT_STAGES = tuple(n for n in STAGE_NAMES if STAGES[n].split)
# run.toml's key (and `check --split-size`'s value): the keys per split of a run that splits.
SPLIT_SIZE_KEY = "split_size"


def split_count(keys: int, split_size: int) -> int:
    """S: the splits of a run that splits `keys` keys (the most any sequence has) K = split_size
    per split: ceil(keys / K), at least 1."""
    return max(1, -(-keys // split_size))


def split_columns(stage: str, dims: "Dims") -> int:
    """The columns of one split in a split stage's matrix: DV for split_output, 1 for split_lse."""
    return dims.d_v if STAGES[stage].cols == "SDV" else 1
KV_STAGES = tuple(n for n in STAGE_NAMES if STAGES[n].kv)

# The tensors a variant case adds to its inputs (verify/variant.py), besides Q, K, V and dO:
# name -> (rows, cols) symbols. mask and bias are one N×M matrix per query head
# (`mask_head_{i}`) or, broadcast over the heads, one file without a head number (`mask.txt`);
# alibi_slopes is one row of H slopes or B rows (`alibi_slopes.txt`), read only with `alibi`.
MASK_INPUT, BIAS_INPUT, ALIBI_SLOPES_INPUT = "mask", "bias", "alibi_slopes"
VARIANT_INPUTS = {MASK_INPUT: ("N", "M"), BIAS_INPUT: ("N", "M"), ALIBI_SLOPES_INPUT: ("B", "H")}
BACKWARD_STAGES = tuple(n for n in STAGE_NAMES if STAGES[n].backward)


# A packed case (verify/sequences.py) stores its N×M stages per sequence (n(b) × m(b) each):
# `<stage>_head_{i}_seq_{b}.<fmt>`; every other stage keeps one file per head over the packed tokens.
HEAD_INFIX, SEQUENCE_INFIX = "_head_", "_seq_"
# A split stage (SPLIT_STAGES) has one file per head and split: `<stage>_head_{i}_split_{s}.<fmt>`.
SPLIT_INFIX = "_split_"
SEQUENCE_STAGES = tuple(n for n in STAGE_NAMES if (STAGES[n].rows, STAGES[n].cols) == ("N", "M"))


def per_sequence(stage: str) -> bool:
    """Whether a packed case stores `stage` per sequence (its rows are queries, its columns keys)."""
    return stage in SEQUENCE_STAGES


def stage_file(stage: str, head: int, fmt: str, seq: Optional[int] = None, split: Optional[int] = None) -> str:
    """File name of one stage's matrix for flat head index `head` (and sequence `seq` of a packed
    case, for the stages stored per sequence; split `split` of a split stage)."""
    tail = ("" if seq is None else f"{SEQUENCE_INFIX}{seq}") + ("" if split is None else f"{SPLIT_INFIX}{split}")
    return f"{stage}{HEAD_INFIX}{head}{tail}.{fmt}"


class StageFileName(tuple):
    """What parse_stage_file reads from a name: (stage, head, fmt) as a tuple, so that the callers
    that unpack three values keep working, `seq`, the sequence of a per-sequence file, and `split`,
    the split of a split stage's file (None for a file per head). A per-sequence or per-split name
    equals no plain tuple: it is not the head's file."""

    def __new__(cls, stage: str, head: int, fmt: str, seq: Optional[int] = None, split: Optional[int] = None):
        obj = super().__new__(cls, (stage, head, fmt))
        obj.seq = seq
        obj.split = split
        return obj

    stage = property(lambda self: self[0])
    head = property(lambda self: self[1])
    fmt = property(lambda self: self[2])

    def __eq__(self, other):
        if isinstance(other, StageFileName):
            return tuple.__eq__(self, other) and (self.seq, self.split) == (other.seq, other.split)
        return self.seq is None and self.split is None and tuple.__eq__(self, other)

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        plain = self.seq is None and self.split is None
        return tuple.__hash__(self) if plain else hash((tuple(self), self.seq, self.split))

    def __repr__(self):
        return f"StageFileName{tuple(self) + (self.seq,) + ((self.split,) if self.split is not None else ())!r}"

    @property
    def name(self) -> str:
        """The file name, as stage_file writes it."""
        return stage_file(self[0], self[1], self[2], self.seq, self.split)


def _number(text: str) -> Optional[int]:
    # str.isdigit takes other scripts' digits, and '²'
    return int(text) if text.isascii() and text.isdigit() else None


def parse_stage_file(name: str) -> Optional[StageFileName]:
    """`QK_scaled_head_3.txt` -> ("QK_scaled", 3, "txt"), `QK_head_3_seq_2.npy` -> ("QK", 3, "npy")
    with seq 2, `split_lse_head_3_split_1.txt` -> ("split_lse", 3, "txt") with split 1; None if the
    name is not a stage file."""
    stem, dot, ext = name.rpartition(".")
    if not dot or ext not in FORMATS or HEAD_INFIX not in stem:
        return None
    stage, _, idx = stem.rpartition(HEAD_INFIX)
    idx, split_infix, split = idx.partition(SPLIT_INFIX)
    head, infix, seq = idx.partition(SEQUENCE_INFIX)
    head_n, seq_n = _number(head), _number(seq) if infix else None
    split_n = _number(split) if split_infix else None
    if head_n is None or (infix and seq_n is None) or (split_infix and split_n is None):
        return None
    return StageFileName(stage, head_n, ext, seq_n, split_n)


def default_scale(d_k: int) -> float:
    return 1.0 / float(d_k) ** 0.5
