// stages.h — the one table of stages in C++: name, shape, and what each stage is computed from.
// Adding a stage means one line here (and one in verify/stages.py); every loop over stages in the
// binary (file names, allocation, dependency closure, timings) is driven by this table.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace attnstep {

// Problem sizes. Heads are numbered i = b*heads + h (batch-major).
struct Dims {
    int batch = 1, heads = 1;
    int N = 0;   // seq_q: query rows
    int M = 0;   // seq_k: key/value rows
    int dk = 0, dv = 0;
    // An int once the case limits hold (case_limit_violation below checks in 64 bits).
    int total_heads() const { return batch * heads; }
};

// The manifest key of each Dims field (input manifest.toml and run.toml; verify/stages.py
// DIM_KEYS), in the order both manifests list them.
using DimField = int Dims::*;  // an alias: nvcc's front end warns on the spelled-out member pointer
struct DimKey {
    const char* key;
    DimField field;
};
inline constexpr DimKey kDimKeys[] = {
    {"batch", &Dims::batch}, {"heads", &Dims::heads}, {"seq_q", &Dims::N},
    {"seq_k", &Dims::M},     {"d_k", &Dims::dk},      {"d_v", &Dims::dv},
};

// Case limits (verify/stages.py MAX_DIM, MAX_HEADS, MAX_ELEMENTS; docs/contract.md): every
// dimension 1..kMaxDim, batch x heads at most kMaxHeads, and the elements of every stage of every
// head at most kMaxElements, so that every element and byte count fits 64 bits (and a head index
// an int). Both readers refuse a case beyond them before reading any matrix.
inline constexpr int kMaxDim = 1 << 24;
inline constexpr long long kMaxHeads = 1LL << 24;
inline constexpr long long kMaxElements = 1LL << 48;

// Input matrix files are checked against their shape before they are read (verify/stages.py
// TEXT_BYTES_PER_VALUE, TEXT_SLACK_BYTES, NPY_MAX_HEADER_BYTES): a text matrix of R x C values is
// at most kTextBytesPerValue * R * C + kTextSlackBytes bytes (room for comments); an .npy header
// dict at most kNpyMaxHeaderBytes (np.load's own limit), and its data exactly R * C float32s.
inline constexpr long long kTextBytesPerValue = 64;
inline constexpr long long kTextSlackBytes = 1 << 16;
inline constexpr long long kNpyMaxHeaderBytes = 10000;

// Head-dimension limits (verify/stages.py MAX_HEAD_DIM, FLASH_HEAD_DIMS): d_k and d_v are
// 1..kMaxHeadDim (shared-memory bounds on the GPU); the flash kernels exist for these widths only
// (flash_supported() in backend.h).
inline constexpr int kMaxHeadDim = 256;
inline constexpr int kFlashHeadDims[] = {16, 32, 64, 128};

// "{16, 32, 64, 128}", for messages.
inline std::string flash_head_dims_text() {
    std::string s;
    for (int w : kFlashHeadDims) s += (s.empty() ? "{" : ", ") + std::to_string(w);
    return s + "}";
}

// Shape symbols used by the table below.
enum class Sym { N, M, DK, DV, ONE };

inline int sym_value(Sym s, const Dims& d) {
    switch (s) {
        case Sym::N: return d.N;
        case Sym::M: return d.M;
        case Sym::DK: return d.dk;
        case Sym::DV: return d.dv;
        case Sym::ONE: return 1;
    }
    return 0;
}

// X(id, rows, cols, from): `from` is the earlier stage whose buffer this stage is computed from,
// beyond the inputs Q, K, V that are always loaded (NONE when it needs only those). Order matters:
// a stage's source comes before it.
#define ATTNSTEP_STAGES(X)                              \
    X(Q,                 N,  DK,  NONE)                 \
    X(K,                 M,  DK,  NONE)                 \
    X(V,                 M,  DV,  NONE)                 \
    X(KT,                DK, M,   NONE)                 \
    X(QK,                N,  M,   NONE)                 \
    X(QK_scaled,         N,  M,   QK)                   \
    X(attention_weights, N,  M,   QK_scaled)            \
    X(output,            N,  DV,  attention_weights)    \
    X(flash_output,      N,  DV,  NONE)                 \
    X(flash_lse,         N,  ONE, NONE)

enum class Stage : int {
#define ATTNSTEP_ENUM(id, r, c, from) id,
    ATTNSTEP_STAGES(ATTNSTEP_ENUM)
#undef ATTNSTEP_ENUM
    NONE
};
constexpr int kNumStages = static_cast<int>(Stage::NONE);

struct StageInfo {
    const char* name;
    Sym rows, cols;
    Stage from;
};

inline const StageInfo& stage_info(Stage s) {
    static const StageInfo table[kNumStages] = {
#define ATTNSTEP_INFO(id, r, c, from) {#id, Sym::r, Sym::c, Stage::from},
        ATTNSTEP_STAGES(ATTNSTEP_INFO)
#undef ATTNSTEP_INFO
    };
    return table[static_cast<int>(s)];
}

inline const char* stage_name(Stage s) { return stage_info(s).name; }
inline int stage_rows(Stage s, const Dims& d) { return sym_value(stage_info(s).rows, d); }
inline int stage_cols(Stage s, const Dims& d) { return sym_value(stage_info(s).cols, d); }
inline size_t stage_elems(Stage s, const Dims& d) {
    return static_cast<size_t>(stage_rows(s, d)) * static_cast<size_t>(stage_cols(s, d));
}

// The elements of every stage of one head (the case-size limit counts these).
inline long long elements_per_head(const Dims& d) {
    long long n = 0;
    for (int i = 0; i < kNumStages; ++i)
        n += static_cast<long long>(stage_rows(static_cast<Stage>(i), d)) * stage_cols(static_cast<Stage>(i), d);
    return n;
}

// Why dimensions that are each within 1..kMaxDim (head widths within kMaxHeadDim) still exceed the
// case limits, or "" when they do not. 64-bit arithmetic: batch x heads may overflow an int.
inline std::string case_limit_violation(const Dims& d) {
    const long long heads = static_cast<long long>(d.batch) * d.heads;
    if (heads > kMaxHeads)
        return "batch x heads = " + std::to_string(heads) + " heads; at most " + std::to_string(kMaxHeads);
    const long long per_head = elements_per_head(d);
    if (per_head > kMaxElements / heads)
        return std::to_string(heads) + " heads of " + std::to_string(per_head) +
               " stage elements each; at most " + std::to_string(kMaxElements) + " elements in all";
    return "";
}

// The flash stages come from the tiled kernel; the rest form the "stage path".
inline bool is_flash_stage(Stage s) { return s == Stage::flash_output || s == Stage::flash_lse; }
inline bool is_input_echo(Stage s) { return s == Stage::Q || s == Stage::K || s == Stage::V; }

// A set of stages as a bit mask over the table.
struct StageSet {
    unsigned bits = 0;
    bool has(Stage s) const { return bits & (1u << static_cast<int>(s)); }
    void add(Stage s) { bits |= 1u << static_cast<int>(s); }
    bool any_flash() const { return has(Stage::flash_output) || has(Stage::flash_lse); }
    static StageSet all() { StageSet s; s.bits = (1u << kNumStages) - 1; return s; }
};

// The selected stages plus everything they are computed from. The flash stages are computed
// together by one kernel, so either one pulls in both.
inline StageSet dependency_closure(StageSet sel) {
    if (sel.any_flash()) { sel.add(Stage::flash_output); sel.add(Stage::flash_lse); }
    for (int i = kNumStages - 1; i >= 0; --i) {
        Stage s = static_cast<Stage>(i);
        if (!sel.has(s)) continue;
        Stage from = stage_info(s).from;
        if (from != Stage::NONE) sel.add(from);
    }
    return sel;
}

// Parses "all", "stages" (the stage path), "flash", or a comma-separated list of stage names.
// Returns false and sets `bad` to the offending token on an unknown name.
bool parse_stage_list(const std::string& text, StageSet* out, std::string* bad);

}  // namespace attnstep
