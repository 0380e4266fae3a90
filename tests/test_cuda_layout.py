"""The shape of the binary's sources (cuda_src/), read as text: no compiler, no GPU, so the CUDA
sources are held to it on a machine without either.

- Every file is at most MAX_FILE_LINES long; a file that holds kernels may be longer (its kernel
  bodies do not count) where LONG_KERNEL_FILES says why it stays in one piece.
- Every host function is at most MAX_FUNCTION_LINES long; kernel and device function bodies
  (__global__, __device__) do not count, and LONG_FUNCTIONS lists the exceptions with their reason.
- The bench harness (`main --bench`) lives in cuda_src/bench/, and no kernel file includes it.
- Each backend computes the stages through a table built from the stage table's rows
  (ATTNSTEP_STAGES in stages.h): a compute_<stage> for every row, no switch or if-chain per stage.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

SRC = Path(__file__).resolve().parent.parent / "cuda_src"
SOURCE_SUFFIXES = {".cpp", ".h", ".cu", ".cuh"}

MAX_FILE_LINES = 400
# The longest host functions today are 62 to 76 lines (CudaBackend::compute, bench.cu's
# bench_stage_path, cli.cpp's parse_cli), each one job told in order; 80 leaves them room for a
# small change, while a function that takes on a second job goes past it.
MAX_FUNCTION_LINES = 80

# Files longer than MAX_FILE_LINES, each one kernel (or one kernel family) with the device
# helpers, tile configurations and launcher that only it uses. The launcher instantiates the
# kernel's templates, so kernel and launcher share one translation unit; splitting the kernel
# body itself would change code that the GPU tests prove. Their host part must still fit.
LONG_KERNEL_FILES: Dict[str, str] = {
    "cuda/flash_bwd.cu": "the flash backward: two kernels (dK/dV over key blocks, dQ over query blocks) "
                         "sharing one parameter block, tile table and device helpers, and their one launcher",
    "cuda/decode.cu": "the split-KV decode kernels with cp.async pipelines: the tensor-core one (bf16/fp16) and "
                      "the CUDA-core one (fp32), and the one launcher that picks between them and Hopper's "
                      "(their shared steps are decode_parts.cuh)",
    "cuda/flash_fast.cu": "the mma.sync flash forward: one kernel, its per-tile device steps and its tile "
                          "configurations (shipped and exploration variants) with the launcher that picks them",
    "cuda/sm90a/flash_wgmma.cu": "the wgmma flash forward: the kernel, the two operand-preparation kernels its "
                                 "launch runs first, and the wgmma peak kernel --bench measures as its ceiling, "
                                 "all compiled for sm_90a alone (CMake's sm90a object library)",
    "cuda/sm90a/flash_wgmma_half.cu": "the bf16/fp16 wgmma flash forward: one kernel, its pipeline of tensor "
                                      "memory copies and its launcher, compiled for sm_90a alone",
    "cuda/sm90a/flash_bwd_wgmma_kernels.cuh": "the wgmma flash backward's two kernels (dK/dV over key blocks, dQ "
                                               "over query blocks) for both operand families (bf16/fp16 and TF32), "
                                               "sharing tiles, barriers, copies and device steps; each family's "
                                               "preparation pass and launcher instantiate them, for sm_90a alone",
}

# Host functions longer than MAX_FUNCTION_LINES (file, function): none today.
LONG_FUNCTIONS: Dict[Tuple[str, str], str] = {}

# The backends' sources: where stage dispatch lives.
BACKEND_SOURCES = ("cpu/*.cpp", "cpu/*.h", "cuda/backend_cuda.cu", "cuda/cuda_stages.cu", "cuda/cuda_stages.cuh")
# Each backend: the file that dispatches, and the file that names its stage functions.
BACKEND_TABLES = {"cpu": ("cpu/backend_cpu.cpp", "cpu/cpu_stages.h"),
                  "cuda": ("cuda/backend_cuda.cu", "cuda/cuda_stages.cuh")}


def _sources() -> List[Path]:
    return sorted(p for p in SRC.rglob("*") if p.suffix in SOURCE_SUFFIXES)


def _rel(path: Path) -> str:
    return path.relative_to(SRC).as_posix() if path.is_relative_to(SRC) else path.name


# ---- reading C++ as text ------------------------------------------------------------------------

def code_only(text: str) -> str:
    """`text` with comments, string and character literals and preprocessor lines blanked (newlines
    kept, so line numbers stay): what is left is declarations, code and braces."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + " " * (j - i - 1) + c)
            i = j + 1
        elif c == "#" and text[text.rfind("\n", 0, i) + 1:i].strip() == "":
            # A preprocessor line, with its continuations (a macro's braces are not code).
            j = i
            while True:
                k = text.find("\n", j)
                if k < 0:
                    k = n
                    break
                if text[k - 1] != "\\":
                    break
                out.append(re.sub(r"[^\n]", " ", text[j:k]) + "\n")
                j = k + 1
            out.append(" " * (k - j))
            i = k
        else:
            out.append(c)
            i += 1
    return "".join(out)


@dataclass
class Function:
    name: str
    first: int  # line of its opening brace (1-based)
    last: int   # line of its closing brace
    device: bool  # __global__ or __device__: runs on the GPU
    body: str

    @property
    def lines(self) -> int:
        return self.last - self.first + 1


_QUALIFIERS = re.compile(r"(\s*(const|override|final|mutable|noexcept(\s*\([^()]*\))?|&&?|->\s*[\w:<>,\s*&]+))+$")


def _is_function_head(head: str) -> bool:
    head = re.sub(r"\b(public|private|protected)\s*:", " ", head).strip()
    if not head or "(" not in head:
        return False
    head = _QUALIFIERS.sub("", head)
    if head.endswith(")"):
        # `T x = f(...)`, `T x{f(...)}` are variables; `operator=(...)` is not.
        depth, i = 0, 0
        for i, ch in enumerate(head):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0 and ch == "=" and not head[:i].rstrip().endswith("operator"):
                return False
        return True
    return bool(re.search(r"\)\s*:(?!:)", head))  # a constructor's member initialisers


def _function_name(head: str) -> str:
    head = re.sub(r"__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)", " ", head)
    head = re.sub(r"^\s*template\s*<.*?>\s*", "", head, flags=re.S)
    match = re.search(r"(operator\s*\S+?|~?[\w:]+)\s*\(", head)
    return match.group(1) if match else head.strip()[:40]


def functions(text: str) -> List[Function]:
    """The function definitions of a source, nested classes and namespaces looked into; lambdas
    and local classes count as part of the function they are in."""
    code = code_only(text)
    found: List[Function] = []
    stack: List[str] = []   # "scope" (namespace, class, extern) or "skip" (initialiser braces)
    head_start, paren = 0, 0
    i, n = 0, len(code)
    while i < n:
        ch = code[i]
        if ch == "(":
            paren += 1
        elif ch == ")":
            paren -= 1
        elif ch in ";" and paren == 0:
            head_start = i + 1
        elif ch == "}" and paren == 0:
            if stack:
                stack.pop()
            head_start = i + 1
        elif ch == "{" and paren == 0:
            head = code[head_start:i]
            if stack and stack[-1] == "skip":
                stack.append("skip")
            elif re.match(r"\s*(inline\s+)?namespace\b|\s*extern\s", head) or (
                    re.search(r"\b(struct|class|union|enum)\b", re.sub(r"template\s*<.*?>", "", head, flags=re.S))
                    and "(" not in re.sub(r"template\s*<.*?>", "", head, flags=re.S)):
                stack.append("scope")
            elif _is_function_head(head):
                depth, j = 1, i + 1
                while depth and j < n:
                    depth += code[j] == "{"
                    depth -= code[j] == "}"
                    j += 1
                found.append(Function(_function_name(head), code.count("\n", 0, i) + 1, code.count("\n", 0, j - 1) + 1,
                                      bool(re.search(r"\b__(global|device)__\b", head)), code[i:j]))
                i, head_start = j, j
                continue
            else:
                stack.append("skip")
            head_start = i + 1
        i += 1
    return found


def host_lines(text: str) -> int:
    """The lines of a source that are not inside a kernel's or device function's body."""
    device = sum(f.lines for f in functions(text) if f.device)
    return text.count("\n") - device


# ---- the reader itself --------------------------------------------------------------------------

_SAMPLE = """
// a comment with { a brace
#define CHECK(x) do { if (!(x)) \\
    fail(); } while (0)
namespace attnstep {
namespace {
struct Tile {
    int rows = 0;
    int size() const { return rows * 2; }
};
constexpr int kTable[] = {1, 2, 3};
template <class T>
__global__ void __launch_bounds__(T::THREADS, 1) kern(const float* x) {
    if (x) { return; }
}
}  // namespace
Widget::Widget(int n) : n_(n), v_(f(n)) {
    auto g = [&](int i) { return i + 1; };
    const char* s = "}";
}
int Widget::count() const {
    return n_;
}
}  // namespace attnstep
"""


def test_the_reader_finds_functions_and_kernel_bodies():
    found = {f.name: f for f in functions(_SAMPLE)}
    assert set(found) == {"size", "kern", "Widget::Widget", "Widget::count"}
    assert found["kern"].device and not found["Widget::Widget"].device
    assert (found["Widget::Widget"].first, found["Widget::Widget"].last) == (17, 20)
    assert found["kern"].lines == 3
    assert host_lines(_SAMPLE) == _SAMPLE.count("\n") - 3


# ---- sizes --------------------------------------------------------------------------------------

def _too_long_files() -> List[str]:
    bad = []
    for path in _sources():
        text, rel = path.read_text(), _rel(path)
        total = text.count("\n")
        if total <= MAX_FILE_LINES:
            continue
        if rel not in LONG_KERNEL_FILES:
            bad.append(f"{rel}: {total} lines (at most {MAX_FILE_LINES}; split it along its jobs)")
        elif host_lines(text) > MAX_FILE_LINES:
            bad.append(f"{rel}: {host_lines(text)} lines of host code (at most {MAX_FILE_LINES})")
    return bad


def test_every_source_file_is_at_most_400_lines_or_a_listed_kernel_file():
    assert _too_long_files() == []


def test_every_listed_kernel_file_exists_holds_a_kernel_and_is_long():
    for rel, why in LONG_KERNEL_FILES.items():
        text = (SRC / rel).read_text()
        assert why and "__global__" in text, rel
        assert text.count("\n") > MAX_FILE_LINES, f"{rel} fits now: drop it from LONG_KERNEL_FILES"


def _too_long_functions() -> List[str]:
    bad = []
    for path in _sources():
        for f in functions(path.read_text()):
            key = (_rel(path), f.name)
            if not f.device and f.lines > MAX_FUNCTION_LINES and key not in LONG_FUNCTIONS:
                bad.append(f"{key[0]}:{f.first} {f.name}: {f.lines} lines (at most {MAX_FUNCTION_LINES})")
    return bad


def test_every_host_function_is_at_most_80_lines():
    assert _too_long_functions() == []


def test_the_size_checks_catch_a_long_host_file_and_function(tmp_path, monkeypatch):
    """A 500-line host file with a 120-line function fails both checks (the checks are not vacuous)."""
    body = "\n".join(f"    total += {i};" for i in range(120))
    filler = "\n".join(f"// line {i}" for i in range(380))
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "long.cpp").write_text(f"int sum() {{\n    int total = 0;\n{body}\n    return total;\n}}\n{filler}\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    assert [line.split(":")[0] for line in _too_long_files()] == ["cpu/long.cpp"]
    assert [line.split(" ")[1] for line in _too_long_functions()] == ["sum:"]


# ---- the bench harness apart from the kernels ---------------------------------------------------

def test_the_bench_harness_lives_in_bench_and_no_kernel_file_includes_it():
    for path in _sources():
        rel = _rel(path)
        if path.name.startswith("bench"):
            assert rel.startswith("bench/"), f"{rel}: the bench harness lives in cuda_src/bench/"
        if rel.startswith("cuda/"):
            for include in re.findall(r'#include\s+"([^"]+)"', path.read_text()):
                assert "bench" not in Path(include).name and "bench/" not in include, \
                    f"{rel} includes {include}: kernels do not depend on the bench harness"


# ---- stage dispatch from the table --------------------------------------------------------------

def stage_rows() -> List[str]:
    """The stage ids of ATTNSTEP_STAGES, in the table's order."""
    text = (SRC / "stages.h").read_text()
    table = text[text.index("#define ATTNSTEP_STAGES(X)"):]
    table = table[:table.index("\n\n")]
    return re.findall(r"^\s*X\((\w+),", table, re.M)


def test_the_stage_table_is_read():
    rows = stage_rows()
    assert rows[:3] == ["Q", "K", "V"] and "flash_dV" in rows and len(rows) == len(set(rows))
    assert re.search(r"#define ATTNSTEP_COMPUTE_FN\(id, [^)]*\) compute_##id,", (SRC / "stages.h").read_text())


@pytest.mark.parametrize("backend", sorted(BACKEND_TABLES))
def test_each_backend_has_a_compute_function_for_every_row(backend):
    dispatcher, names = (SRC / p for p in BACKEND_TABLES[backend])
    code = code_only(dispatcher.read_text())
    table = re.search(r"kComputeStage\[kNumStages\]\s*=\s*\{\s*ATTNSTEP_STAGES\(ATTNSTEP_COMPUTE_FN\)\s*\}", code)
    assert table, f"{dispatcher.name}: the stage functions' array is built from ATTNSTEP_STAGES"
    called = re.search(r"kComputeStage\[i\]\(", code)
    assert called, f"{dispatcher.name} calls the stages through kComputeStage"
    declared = set(re.findall(r"\bcompute_(\w+)\b", code_only(names.read_text())))
    missing = [s for s in stage_rows() if s not in declared]
    assert missing == [], f"{names.name}: no compute_<stage> for {missing}"


def _stage_branches(body: str) -> List[str]:
    """The stages that `if` conditions in a function body single out (`s == Stage::X`,
    `set.has(Stage::X)`), one entry per condition."""
    conditions = re.findall(r"\bif\s*\(((?:[^()]|\((?:[^()]|\([^()]*\))*\))*)\)", body)
    return [stage for c in conditions for stage in re.findall(r"(?:==\s*|\.has\(\s*)Stage::(\w+)", c)]


def _per_stage_dispatch(sources) -> List[str]:
    bad = []
    for path in sources:
        code = code_only(path.read_text())
        if re.search(r"\bcase\s+Stage::", code):
            bad.append(f"{_rel(path)}: a switch over stages (dispatch through kComputeStage)")
        for f in functions(path.read_text()):
            if len(set(_stage_branches(f.body))) > 2:
                bad.append(f"{_rel(path)}: {f.name} branches on stages {sorted(set(_stage_branches(f.body)))}")
    return bad


def _backend_sources() -> List[Path]:
    return sorted({p for pattern in BACKEND_SOURCES for p in SRC.glob(pattern)})


def test_no_backend_dispatches_stages_by_switch_or_if_chain():
    assert _backend_sources() and _per_stage_dispatch(_backend_sources()) == []


def test_the_dispatch_check_catches_a_switch_and_an_if_chain(tmp_path):
    """A switch over stages, or a function of three `if`s on stages, fails (the check is not vacuous);
    one or two stages singled out (a memory estimate, a guard) do not."""
    switch = tmp_path / "switch.cpp"
    switch.write_text("void run(Stage s) {\n    switch (s) {\n        case Stage::QK: qk(); break;\n"
                      "        default: break;\n    }\n}\n")
    chain = tmp_path / "chain.cu"
    chain.write_text("void run(StageSet computed) {\n    if (computed.has(Stage::KT)) kt();\n"
                     "    if (computed.has(Stage::QK)) {\n        qk();\n    }\n    if (s == Stage::dP) dp();\n}\n")
    fine = tmp_path / "fine.cpp"
    fine.write_text("size_t bytes(StageSet c) {\n    if (c.has(Stage::flash_dQ)) return 1;\n"
                    "    if (c.has(Stage::QK) && c.has(Stage::QK)) return 2;\n    return 0;\n}\n")
    assert [line.split(":")[0] for line in _per_stage_dispatch([switch, chain, fine])] == ["switch.cpp", "chain.cu"]
