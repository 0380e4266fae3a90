// stages.h — the one table of stages in C++: name, shape, and what each stage is computed from.
// Adding a stage is one row here (and its twin in verify/stages.py) plus, in each backend, the
// function that computes it: both backends dispatch through an array built from this table
// (ATTNSTEP_COMPUTE_FN below), so a row without its function does not compile. Every other loop
// over stages in the binary (file names, allocation, dependency closure, timings) is driven by the
// table alone.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "common.h"

namespace attnstep {

// Problem sizes. Heads are numbered i = b*heads + h (batch-major).
struct Dims {
    int batch = 1, heads = 1;
    int N = 0;   // seq_q: query rows
    int M = 0;   // seq_k: key/value rows
    int dk = 0, dv = 0;
    // K/V heads per batch element (GQA/MQA: a divisor of heads; manifest key kv_heads); 0 means one
    // per query head. Query head h reads K/V head h / (heads / kv_heads) (verify/stages.py Dims).
    int kv_heads = 0;
    // The key splits S of a run that splits (Problem::split_size, the flash-decoding stages); 0 in
    // a run that does not, where the split stages have no elements. Not a manifest key: run.toml
    // records the split size, and S follows from it (split_count in backend.h).
    int splits = 0;
    // An int once the case limits hold (case_limit_violation below checks in 64 bits).
    int total_heads() const { return batch * heads; }
    int kv() const { return kv_heads > 0 ? kv_heads : heads; }
    int total_kv_heads() const { return batch * kv(); }
    int group_size() const { return heads / kv(); }
    // The flat K/V head the flat query head i = b·H + h reads: b·Hk + h / (H/Hk).
    int kv_head_of(int head) const { return head / heads * kv() + head % heads / group_size(); }
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
// The optional manifest key of Dims::kv_heads (verify/stages.py KV_HEADS_KEY): absent in a case
// without grouped K/V heads; run.toml always records it.
inline constexpr const char kKvHeadsKey[] = "kv_heads";

// The variant's input files (verify/stages.py VARIANT_INPUTS): mask and bias are N×M per query head
// (`mask_head_<i>`) or one file broadcast over the heads (`mask`); alibi_slopes holds 1 or batch
// rows of `heads` slopes. In the case's format, read only when the variant asks for them.
inline constexpr const char kMaskInput[] = "mask";
inline constexpr const char kBiasInput[] = "bias";
inline constexpr const char kAlibiSlopesInput[] = "alibi_slopes";

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

// Shape symbols used by the table below. S_DV and S are the split stages' widths: S splits of d_v
// columns (split s at columns [s·d_v, (s+1)·d_v)) and one lse column per split; the writer cuts
// them into one N×d_v and one N×1 file per split (stage_file_name's split).
enum class Sym { N, M, DK, DV, ONE, S_DV, S };

inline int sym_value(Sym s, const Dims& d) {
    switch (s) {
        case Sym::N: return d.N;
        case Sym::M: return d.M;
        case Sym::DK: return d.dk;
        case Sym::DV: return d.dv;
        case Sym::ONE: return 1;
        case Sym::S_DV: return d.splits * d.dv;  // fits an int: main.cpp refuses more splits
        case Sym::S: return d.splits;
    }
    return 0;
}

// X(id, rows, cols, pass, kind, (sources...)), in verify/stages.py's order:
//   pass    fwd, or bwd: a backward stage, which exists only when the case has the output gradient dO;
//   kind    input (the echo of an input the binary reads), path (the stage path) or flash (the tiled
//           kernel's stages: those of one pass are computed together, so one pulls in all of them);
//   sources the earlier stages whose buffers this stage is computed from, beyond the inputs (Q, K,
//           V and dO), which are always loaded. A stage's sources come before it.
#define ATTNSTEP_STAGES(X)                                                                      \
    X(Q,                 N,  DK,  fwd, input, ())                                               \
    X(K,                 M,  DK,  fwd, input, ())                                               \
    X(V,                 M,  DV,  fwd, input, ())                                               \
    X(KT,                DK, M,   fwd, path,  ())                                               \
    X(QK,                N,  M,   fwd, path,  ())                                               \
    X(QK_scaled,         N,  M,   fwd, path,  (QK))                                             \
    X(attention_weights, N,  M,   fwd, path,  (QK_scaled))                                      \
    X(dropout_mask,      N,  M,   fwd, path,  ())                                               \
    X(output,            N,  DV,  fwd, path,  (attention_weights, dropout_mask))                \
    X(split_output,      N,  S_DV, fwd, flash, ())                                              \
    X(split_lse,         N,  S,   fwd, flash, ())                                               \
    X(flash_output,      N,  DV,  fwd, flash, ())                                               \
    X(flash_lse,         N,  ONE, fwd, flash, ())                                               \
    X(dO,                N,  DV,  bwd, input, ())                                               \
    X(D,                 N,  ONE, bwd, path,  (output))                                         \
    X(dP,                N,  M,   bwd, path,  ())                                               \
    X(dS,                N,  M,   bwd, path,  (attention_weights, dropout_mask, dP, D))         \
    X(dQ,                N,  DK,  bwd, path,  (dS, QK))                                         \
    X(dK,                M,  DK,  bwd, path,  (dS, QK))                                         \
    X(dV,                M,  DV,  bwd, path,  (attention_weights, dropout_mask))                \
    X(flash_dQ,          N,  DK,  bwd, flash, (flash_output, flash_lse))                        \
    X(flash_dK,          M,  DK,  bwd, flash, (flash_output, flash_lse))                        \
    X(flash_dV,          M,  DV,  bwd, flash, (flash_output, flash_lse))

// Each backend computes stage X with a function compute_X of its own and calls it through an array
// indexed by Stage that this macro fills in the table's order:
//   constexpr StageFunction kComputeStage[kNumStages] = {ATTNSTEP_STAGES(ATTNSTEP_COMPUTE_FN)};
// so a row without its compute_X is a compile error. A stage that another stage's function writes
// (computed_together() below: flash_lse with flash_output) names a null compute_X, never called.
#define ATTNSTEP_COMPUTE_FN(id, r, c, pass, kind, sources) compute_##id,

enum class Stage : int {
#define ATTNSTEP_ENUM(id, r, c, pass, kind, sources) id,
    ATTNSTEP_STAGES(ATTNSTEP_ENUM)
#undef ATTNSTEP_ENUM
    NONE
};
constexpr int kNumStages = static_cast<int>(Stage::NONE);
static_assert(kNumStages <= 32, "StageSet is a 32-bit mask");

enum class Pass { fwd, bwd };
enum class StageKind { input, path, flash };

// The stage names as constants of their own, so that the table's source lists can name them bare.
namespace stage_ids {
#define ATTNSTEP_ID(id, r, c, pass, kind, sources) inline constexpr Stage id = Stage::id;
ATTNSTEP_STAGES(ATTNSTEP_ID)
#undef ATTNSTEP_ID
}  // namespace stage_ids

// The bit mask of a list of stages.
template <typename... S>
constexpr unsigned stage_mask(S... s) { return (0u | ... | (1u << static_cast<int>(s))); }

struct StageInfo {
    const char* name;
    Sym rows, cols;
    Pass pass;
    StageKind kind;
    unsigned sources;  // a mask over the table
};

inline const StageInfo& stage_info(Stage s) {
    using namespace stage_ids;
    static const StageInfo table[kNumStages] = {
#define ATTNSTEP_INFO(id, r, c, pass, kind, sources) \
    {#id, Sym::r, Sym::c, Pass::pass, StageKind::kind, stage_mask sources},
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

// Whether a stage is indexed by K/V head (verify/stages.py Stage.kv: K, V, KT, dK, dV, flash_dK,
// flash_dV): the stages whose shape has the key rows M but no query rows N, so none depends on
// a query head alone. A grouped case writes them once per K/V head (B·Hk files).
inline bool is_kv_stage(Stage s) {
    const StageInfo& i = stage_info(s);
    return (i.rows == Sym::M || i.cols == Sym::M) && i.rows != Sym::N && i.cols != Sym::N;
}
// Whether a stage is N×M, one value per query and key (QK, QK_scaled, attention_weights,
// dropout_mask, dP, dS). A packed case stores these per sequence (n(b) × m(b) each, sequences.h);
// every other stage keeps one file per head over the packed tokens.
inline bool is_score_stage(Stage s) {
    const StageInfo& i = stage_info(s);
    return i.rows == Sym::N && i.cols == Sym::M;
}

// The name of a stage file: "<stage>_head_<i>.<ext>", "<stage>_head_<i>_seq_<b>.<ext>" for a
// score stage of sequence b of a packed case (seq >= 0), or "<stage>_head_<i>_split_<s>.<ext>" for
// split s of a split stage (split >= 0). The one place the binary spells a stage file's name
// (verify/stages.py stage_file is the twin).
inline constexpr const char kHeadInfix[] = "_head_";
inline constexpr const char kSequenceInfix[] = "_seq_";
inline constexpr const char kSplitInfix[] = "_split_";
inline std::string stage_file_name(const std::string& stage, int head, const char* ext, int seq = -1,
                                   int split = -1) {
    return stage + kHeadInfix + std::to_string(head) + (seq >= 0 ? kSequenceInfix + std::to_string(seq) : "") +
           (split >= 0 ? kSplitInfix + std::to_string(split) : "") + "." + ext;
}

// How many files of stage s a case has: one per query head, or one per K/V head.
inline int heads_of(Stage s, const Dims& d) { return is_kv_stage(s) ? d.total_kv_heads() : d.total_heads(); }

// The stage that exists only in a case with dropout: the program's keep-mask (verify/stages.py
// DROPOUT_MASK, Stage.dropout). A run without dropout neither computes nor writes it.
inline constexpr const char kDropoutMaskStage[] = "dropout_mask";
inline bool is_dropout_stage(Stage s) { return std::string(stage_name(s)) == kDropoutMaskStage; }

// The run.toml key of a run that splits: the keys per split K (Problem::split_size).
inline constexpr const char kSplitSizeKey[] = "split_size";

// The split-KV stages (flash-decoding's per-split output and lse): they exist only in a run that
// splits (Problem::split_size > 0), one file per split; verify/stages.py names the same ones.
inline bool is_split_stage(Stage s) {
    const Sym c = stage_info(s).cols;
    return c == Sym::S_DV || c == Sym::S;
}

inline bool is_flash_stage(Stage s) { return stage_info(s).kind == StageKind::flash; }
inline bool is_input_echo(Stage s) { return stage_info(s).kind == StageKind::input; }
inline bool is_backward_stage(Stage s) { return stage_info(s).pass == Pass::bwd; }
// The row statistics stay float32 in the half pipelines, as FlashAttention keeps its lse and D:
// every other stage holds values of the run's format (verify/stages.py's FLOAT32_STAGES).
// The split stages too: flash-attn keeps its out_accum and lse_accum float32, and the combine reads
// them so.
inline bool kept_float32(Stage s) { return s == Stage::flash_lse || s == Stage::D || is_split_stage(s); }

// The elements of every stage of one head (the case-size limit counts these; verify/stages.py
// Dims.elements_per_head): the backward stages count only for a case that has dO, the dropout
// stage only for a case with dropout, the split stages only in a run that splits (d.splits > 0).
// `which`: every stage, only those indexed by K/V head (is_kv_stage), or only the others.
enum class KvStages { all, only, none };
inline long long elements_per_head(const Dims& d, bool backward, bool dropout, KvStages which = KvStages::all) {
    long long n = 0;
    for (int i = 0; i < kNumStages; ++i) {
        const Stage s = static_cast<Stage>(i);
        if (which != KvStages::all && is_kv_stage(s) != (which == KvStages::only)) continue;
        if ((is_backward_stage(s) && !backward) || (is_dropout_stage(s) && !dropout)) continue;
        if (is_split_stage(s) && d.splits == 0) continue;
        n += static_cast<long long>(stage_rows(s, d)) * stage_cols(s, d);
    }
    return n;
}

// Why dimensions that are each within 1..kMaxDim (head widths within kMaxHeadDim) still exceed the
// case limits, or "" when they do not (verify/files/manifests.py check_case_limits says the same).
// The stages indexed by K/V head count once per K/V head; backward and dropout as in
// elements_per_head. 64-bit arithmetic: batch x heads may overflow an int, and per_head x heads is
// checked by division.
inline std::string case_limit_violation(const Dims& d, bool backward, bool dropout) {
    const long long heads = static_cast<long long>(d.batch) * d.heads;
    if (heads > kMaxHeads)
        return "batch x heads = " + plural(heads, "head") + "; at most " + std::to_string(kMaxHeads);
    const long long kv_heads = static_cast<long long>(d.batch) * d.kv();
    const long long per_head = elements_per_head(d, backward, dropout, KvStages::none);
    const long long per_kv_head = elements_per_head(d, backward, dropout, KvStages::only);
    const bool over = per_head > kMaxElements / heads ||
                      per_kv_head > (kMaxElements - per_head * heads) / kv_heads;
    if (!over) return "";
    if (kv_heads == heads)
        return plural(heads, "head") + " of " + plural(per_head + per_kv_head, "stage element") +
               " each; at most " + std::to_string(kMaxElements) + " elements in all";
    return plural(heads, "query head") + " of " + plural(per_head, "stage element") + " each and " +
           plural(kv_heads, "K/V head") + " of " + std::to_string(per_kv_head) + " each; at most " +
           std::to_string(kMaxElements) + " elements in all";
}

// A set of stages as a bit mask over the table.
struct StageSet {
    unsigned bits = 0;
    bool has(Stage s) const { return bits & (1u << static_cast<int>(s)); }
    void add(Stage s) { bits |= 1u << static_cast<int>(s); }
    bool any(StageSet other) const { return (bits & other.bits) != 0; }
    bool empty() const { return bits == 0; }
    int count() const {
        int n = 0;
        for (unsigned b = bits; b; b &= b - 1) ++n;
        return n;
    }
    StageSet minus(StageSet other) const { return StageSet{bits & ~other.bits}; }
    StageSet both(StageSet other) const { return StageSet{bits & other.bits}; }
    // The stages for which pred(s) holds.
    template <typename Pred>
    static StageSet where(Pred pred) {
        StageSet out;
        for (int i = 0; i < kNumStages; ++i)
            if (pred(static_cast<Stage>(i))) out.add(static_cast<Stage>(i));
        return out;
    }
    static StageSet all() { return StageSet{(1u << kNumStages) - 1}; }
    static StageSet flash() { return where(is_flash_stage); }
    static StageSet backward() { return where(is_backward_stage); }
    static StageSet dropout() { return where(is_dropout_stage); }
    static StageSet splits() { return where(is_split_stage); }
    bool any_flash() const { return any(flash()); }
    bool any_backward() const { return any(backward()); }
};

// The input stages (Q, K, V, dO) in table order; without the backward ones (dO) when `backward`
// is false.
inline std::vector<Stage> input_stages(bool backward = true) {
    std::vector<Stage> v;
    for (int i = 0; i < kNumStages; ++i) {
        const Stage s = static_cast<Stage>(i);
        if (is_input_echo(s) && (backward || !is_backward_stage(s))) v.push_back(s);
    }
    return v;
}

// The inputs a run reads: Q, K, V, and dO when a backward stage is computed.
inline std::vector<Stage> inputs_read(StageSet computed) { return input_stages(computed.any_backward()); }

// The stages computed together with s: the flash stages of its pass (one kernel writes them all),
// or s alone.
inline StageSet computed_together(Stage s) {
    if (!is_flash_stage(s)) return StageSet{1u << static_cast<int>(s)};
    return StageSet::where([s](Stage t) { return is_flash_stage(t) && stage_info(t).pass == stage_info(s).pass; });
}

// True for the first computed stage of its computed_together() set: the one a backend computes the
// set at (split_output in a run that splits, flash_output in one that does not).
inline bool leads_computation(Stage s, StageSet computed) {
    const unsigned together = computed_together(s).bits & computed.bits;
    return (together & ((1u << static_cast<int>(s)) - 1)) == 0;
}

// The selected stages plus everything they are computed from, and everything computed with them.
inline StageSet dependency_closure(StageSet sel) {
    for (StageSet before; before.bits != sel.bits;) {
        before = sel;
        for (int i = 0; i < kNumStages; ++i) {
            const Stage s = static_cast<Stage>(i);
            if (before.has(s)) sel.bits |= computed_together(s).bits | stage_info(s).sources;
        }
    }
    return sel;
}

// Parses a comma-separated list of stage names and the groups "all" (every stage), "stages" (the
// stage path: every stage that is not a flash stage) and "flash" (the flash stages). The groups
// take the backward stages too; the caller drops them for a case without dO. `named` (optional)
// gets the stages named one by one, which the caller must not drop silently. Returns false and
// sets `bad` to the offending token on an unknown name.
bool parse_stage_list(const std::string& text, StageSet* out, std::string* bad, StageSet* named = nullptr);

}  // namespace attnstep
