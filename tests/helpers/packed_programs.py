"""A float32 NumPy program for packed (varlen) cases, written from docs/contract.md's semantics
(not from verify/): B sequences packed along the tokens, flash-attn's cu_seqlens_q, cu_seqlens_k
and seqused_k; sequence b's queries see only the first m(b) keys of its own slot, the causal mask
and window aligned within the sequence; a sequence without keys outputs 0 and lse −inf. It writes
the input case (no manifest: the cu_seqlens files make it packed) and the stage files as another
program would: `%g` text, no run.toml, the per-token stages over the packed rows and the N×M
stages one file per head and sequence (`<stage>_head_{i}_seq_{b}.txt`). A bug changes what the
program computes and writes (BUGS names each).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

f32 = np.float32

BUGS = {
    "leak": "sequence b also reads sequence b-1's keys (attention across the boundary)",
    "off_by_one": "sequence b's keys start one row early (the boundary off by one)",
    "padding_read": "seqused_k ignored: the padding keys of a slot are read",
    "padding_dk": "a padding key row of dK (and flash_dK) left nonzero",
    "top_left": "the causal mask aligned top-left in every sequence (bottom-right asked)",
    "kv_modulo": "query head h reads K/V head h % Hk (interleaved), not h // (H/Hk)",
    "cu_q_for_keys": "sequence b's keys read at cu_seqlens_q's offsets (the queries' array passed for the keys')",
}

PER_TOKEN = ("Q", "K", "V", "KT", "output", "flash_output", "flash_lse", "dO", "D", "dQ", "dK", "dV",
             "flash_dQ", "flash_dK", "flash_dV")
PER_SEQUENCE = ("QK", "QK_scaled", "attention_weights", "dP", "dS")
FORWARD = ("Q", "K", "V", "KT", "QK", "QK_scaled", "attention_weights", "output", "flash_output", "flash_lse")
BACKWARD = ("dO", "D", "dP", "dS", "dQ", "dK", "dV", "flash_dQ", "flash_dK", "flash_dV")
FLASH = ("flash_output", "flash_lse", "flash_dQ", "flash_dK", "flash_dV")


@dataclass
class PackedCase:
    """The case: query lengths, key slot lengths, the keys used (None: the slots), heads."""
    seqlens_q: Sequence[int]
    seqlens_k: Sequence[int]
    seqused_k: Optional[Sequence[int]] = None
    heads: int = 2
    kv_heads: int = 2
    d: int = 16
    seed: int = 0
    causal: bool = False
    # "bf16": the inputs rounded to bf16, the unnormalised weights rounded before P·V and the
    # output after the division (a flash kernel's half pipeline); the forward alone.
    precision: Optional[str] = None
    inputs: Dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def cu_q(self) -> List[int]:
        return [0] + list(np.cumsum(self.seqlens_q).tolist())

    @property
    def cu_k(self) -> List[int]:
        return [0] + list(np.cumsum(self.seqlens_k).tolist())

    @property
    def count(self) -> int:
        return len(self.seqlens_q)

    def used(self, b: int) -> int:
        return self.seqlens_k[b] if self.seqused_k is None else self.seqused_k[b]

    @property
    def scale(self) -> float:
        return 1.0 / np.sqrt(self.d)

    def draw(self) -> None:
        rng = np.random.default_rng(self.seed)
        tq, tk = self.cu_q[-1], self.cu_k[-1]
        for name, heads, rows in (("Q", self.heads, tq), ("K", self.kv_heads, tk), ("V", self.kv_heads, tk),
                                  ("dO", self.heads, tq)):
            self.inputs[name] = rng.standard_normal((heads, rows, self.d)).astype(f32)


def write_text(path: Path, mat: np.ndarray, fmt: str = "%g") -> None:
    mat = np.asarray(mat)
    mat = mat.reshape(mat.shape[0], -1) if mat.ndim else mat.reshape(1, 1)
    with open(path, "w") as f:
        for row in mat:
            f.write(" ".join(fmt % x for x in row) + "\n")


def write_case(case: PackedCase, folder: Path) -> None:
    """The input case: Q, K, V, dO per head (%.9g: exactly the float32 values), cu_seqlens_q,
    cu_seqlens_k (and seqused_k) one integer a line; no manifest."""
    folder.mkdir(parents=True, exist_ok=True)
    case.draw()
    for name, x in case.inputs.items():
        for i, mat in enumerate(x):
            write_text(folder / f"{name}_head_{i}.txt", mat, "%.9g")
    for name, values in (("cu_seqlens_q", case.cu_q), ("cu_seqlens_k", case.cu_k), ("seqused_k", case.seqused_k)):
        if values is not None:
            (folder / f"{name}.txt").write_text("".join(f"{int(v)}\n" for v in values))


def _key_rows(case: PackedCase, b: int, bug: Optional[str]) -> range:
    start, used = case.cu_k[b], case.used(b)
    if bug == "leak" and b > 0:
        return range(case.cu_k[b - 1], start + used)
    if bug == "off_by_one" and b > 0:
        return range(start - 1, start + used)
    if bug == "padding_read":
        return range(start, case.cu_k[b + 1])
    if bug == "cu_q_for_keys":
        return range(case.cu_q[b], case.cu_q[b + 1])
    return range(start, start + used)


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 to the nearest bf16 (ties to even), as float32: the top 16 bits, rounded."""
    bits = np.ascontiguousarray(x, dtype=f32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.astype(np.uint32).view(f32)


def _hidden(n: int, m: int, causal: bool, bottom_right: bool) -> np.ndarray:
    if not causal:
        return np.zeros((n, m), bool)
    diag = np.arange(n)[:, None] + (m - n if bottom_right else 0)
    return np.arange(m)[None, :] > diag


def program_stages(case: PackedCase, bug: Optional[str] = None):
    """Every stage of every head and sequence in float32: ({per-token stage: (heads, rows, cols)},
    {(N×M stage, head, sequence): its block})."""
    if not case.inputs:
        case.draw()
    group = case.heads // case.kv_heads
    tq, tk, d = case.cu_q[-1], case.cu_k[-1], case.d
    scale = f32(case.scale)
    per_token = {s: np.zeros((case.heads, tq, d), f32) for s in ("output", "dQ")}
    per_token["lse"] = np.zeros((case.heads, tq), f32)
    per_token["D"] = np.zeros((case.heads, tq), f32)
    dk = np.zeros((case.kv_heads, tk, d), f32)
    dv = np.zeros((case.kv_heads, tk, d), f32)
    blocks: Dict[Tuple[str, int, int], np.ndarray] = {}
    Q, K, V, dO = (case.inputs[n] for n in ("Q", "K", "V", "dO"))
    for h in range(case.heads):
        kv = h % case.kv_heads if bug == "kv_modulo" else h // group
        for b in range(case.count):
            qr = slice(case.cu_q[b], case.cu_q[b + 1])
            kr = _key_rows(case, b, bug)
            n, m = qr.stop - qr.start, len(kr)
            if n == 0:
                continue
            if m == 0:
                per_token["lse"][h, qr] = -np.inf
                continue
            q, k, v, do = Q[h, qr], K[kv, kr.start:kr.stop], V[kv, kr.start:kr.stop], dO[h, qr]
            if case.precision == "bf16":
                q, k, v = bf16(q), bf16(k), bf16(v)
            qk = (q @ k.T).astype(f32)
            s = (qk * scale).astype(f32)
            hide = _hidden(n, m, case.causal, bottom_right=bug != "top_left")
            s = np.where(hide, f32(-np.inf), s)
            mx = np.max(s, axis=1, keepdims=True)
            e = np.exp(s - mx).astype(f32)
            tot = e.sum(axis=1, keepdims=True, dtype=f32)
            p = (e / tot).astype(f32)
            o = (p @ v).astype(f32) if case.precision != "bf16" else bf16((bf16(e) @ v) / tot)
            lse = (mx + np.log(tot)).astype(f32)[:, 0]
            dd = np.sum(do * o, axis=1, dtype=f32)
            dp = (do @ v.T).astype(f32)
            ds = (p * (dp - dd[:, None])).astype(f32)
            per_token["output"][h, qr], per_token["lse"][h, qr], per_token["D"][h, qr] = o, lse, dd
            per_token["dQ"][h, qr] = (scale * (ds @ k)).astype(f32)
            dk[kv, kr.start:kr.stop] += (scale * (ds.T @ q)).astype(f32)
            dv[kv, kr.start:kr.stop] += (p.T @ do).astype(f32)
            for name, x in (("QK", qk), ("QK_scaled", s), ("attention_weights", p), ("dP", dp), ("dS", ds)):
                blocks[name, h, b] = x
    if bug == "padding_dk":
        pad = next(case.cu_k[b] + case.used(b) for b in range(case.count) if case.used(b) < case.seqlens_k[b])
        dk = dk.copy()
        dk[0, pad] = f32(0.5)
    whole = {"Q": Q, "K": K, "V": V, "KT": K.transpose(0, 2, 1), "dO": dO,
             "output": per_token["output"], "flash_output": per_token["output"],
             "flash_lse": per_token["lse"][..., None], "D": per_token["D"][..., None],
             "dQ": per_token["dQ"], "flash_dQ": per_token["dQ"], "dK": dk, "flash_dK": dk, "dV": dv, "flash_dV": dv}
    return whole, blocks


def run_program(case: PackedCase, out: Path, stages: Sequence[str] = FORWARD + BACKWARD,
                bug: Optional[str] = None) -> None:
    """Computes every stage of every head and sequence and writes those in `stages`."""
    out.mkdir(parents=True, exist_ok=True)
    whole, blocks = program_stages(case, bug)
    for stage in stages:
        if stage in whole:
            for i, mat in enumerate(whole[stage]):
                write_text(out / f"{stage}_head_{i}.txt", mat)
        else:
            for (name, h, b), mat in blocks.items():
                if name == stage:
                    write_text(out / f"{stage}_head_{h}_seq_{b}.txt", mat)


def load_packed(in_dir: Path, out_dir: Path, opts=None):
    """(run, case) opened as `attnstep check` opens them; the case's packing read from its files
    where the case reader does not (yet) read it."""
    from verify.check.compare import Options
    from verify.files.case import load_input_case, read_matrix
    from verify.files.outputs import open_run
    from verify.sequences import packed_sequences

    opts = opts or Options()
    case = load_input_case(in_dir)
    if case.sequences is None:
        offsets = [read_matrix(in_dir / f"{n}.txt")[:, 0].astype(int) if (in_dir / f"{n}.txt").exists() else None
                   for n in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k")]
        case.sequences = packed_sequences(*offsets)
    return open_run(out_dir, case, opts.overrides()), case


def check_packed(in_dir: Path, out_dir: Path, opts=None):
    """The report `attnstep check` makes of a packed run (its diagnoses included)."""
    from verify.check.compare import Options, check_run
    from verify.diagnose.hypotheses import diagnose

    opts = opts or Options(jobs=1)
    run, case = load_packed(in_dir, out_dir, opts)
    return check_run(run, case, opts, diagnoser=diagnose)
