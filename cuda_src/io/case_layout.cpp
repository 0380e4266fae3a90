// case_layout.cpp — finding and checking input/output case folders; see case_layout.h.
#include "case_layout.h"

#include <filesystem>
#include <optional>
#include <set>
#include <system_error>
#include <utility>
#include <vector>

#include "../backend.h"
#include "../common.h"
#include "input_file.h"
#include "input_manifest.h"
#include "manifest.h"
#include "new_key_inputs.h"
#include "sequence_inputs.h"
#include "variant_inputs.h"

namespace fs = std::filesystem;

namespace attnstep {

namespace {

std::string join(const std::string& dir, const std::string& name) { return dir + "/" + name; }

// ------------------------------------------------------------ the folder's head files
// indices[fmt][stage] = the head numbers present, from names "<input>_head_<i>.<txt|npy>" of the
// input stages (Q, K, V, dO).
struct HeadFiles {
    std::set<int> indices[2][kNumStages];
    const std::set<int>& of(Format f, Stage s) const { return indices[static_cast<int>(f)][static_cast<int>(s)]; }
};

HeadFiles list_head_files(const std::string& dir) {
    HeadFiles hf;
    std::error_code ec;
    for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
        std::string name = e.path().filename().string();
        for (int fi = 0; fi < 2; ++fi)
            for (Stage input : input_stages()) {
                std::string prefix = std::string(stage_name(input)) + "_head_";
                std::string suffix = std::string(".") + format_name(static_cast<Format>(fi));
                if (name.size() <= prefix.size() + suffix.size() || name.compare(0, prefix.size(), prefix) ||
                    name.compare(name.size() - suffix.size(), suffix.size(), suffix))
                    continue;
                std::string num = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
                if (num.empty() || num.size() > 9 || num.find_first_not_of("0123456789") != std::string::npos ||
                    (num.size() > 1 && num[0] == '0'))
                    continue;
                hf.indices[fi][static_cast<int>(input)].insert(std::stoi(num));
            }
    }
    if (ec) fail(kExitBadInput, dir + ": cannot list the folder: " + ec.message());
    return hf;
}

Format detect_format(const std::string& dir, const HeadFiles& hf) {
    bool txt = hf.of(Format::txt, Stage::Q).count(0), npy = hf.of(Format::npy, Stage::Q).count(0);
    if (txt && npy)
        fail(kExitBadInput, dir + ": both Q_head_0.txt and Q_head_0.npy exist",
             "remove one, or add format = \"txt\" (or \"npy\") to manifest.toml");
    if (!txt && !npy)
        fail(kExitBadInput, join(dir, head_file_name(Stage::Q, 0, Format::txt)) +
                                ": missing (no Q_head_0.txt or Q_head_0.npy in the input folder)",
             "generate a case with `attnstep generate`, or point --in at a case folder");
    return txt ? Format::txt : Format::npy;
}

// Whether the case has dO: the manifest's `backward` when it says, else whether any dO file of the
// case's format exists (then every head needs one, which check_head_files says).
bool decide_backward(const InputCase& c, const HeadFiles& hf, const Manifest* m) {
    const std::set<int>& grads = hf.of(c.format, Stage::dO);
    const ManifestValue* flag = m ? m->find("backward") : nullptr;
    if (!flag) return !grads.empty();
    if (!flag->b && !grads.empty())
        fail(kExitBadInput, c.file(Stage::dO, *grads.begin()) + ": exists but " + m->where("backward") +
                                " says backward = false",
             "remove the dO files, or set backward = true in manifest.toml");
    return flag->b;
}

// Why a dO file is required: the manifest's flag, or the case's other dO files.
std::string why_grad_needed(bool flagged) {
    return flagged ? "the manifest says backward = true" : "the case has dO files, so every head needs one";
}

// How many files of an input the case has, in words: "the manifest's batch*heads = 6", "6 heads
// (Q_head_0..5 with no gaps)".
std::string count_words(const InputCase& c, Stage input, bool from_manifest) {
    const int total = heads_of(input, c.dims);
    const bool kv = is_kv_stage(input) && c.dims.kv() != c.dims.heads;
    if (from_manifest)
        return std::string("the manifest's batch*") + (kv ? kKvHeadsKey : "heads") + " = " + std::to_string(total);
    const char* first = kv ? "K" : "Q";
    return plural(total, kv ? "K/V head" : "head") + " (" + first + "_head_0.." + std::to_string(total - 1) +
           " with no gaps)";
}

// Every input file for heads 0..heads_of(input)-1 exists, and none beyond.
void check_head_files(const InputCase& c, const HeadFiles& hf, bool from_manifest, bool grad_flagged) {
    for (Stage input : c.inputs()) {
        const int total = heads_of(input, c.dims);
        const std::string count_word = count_words(c, input, from_manifest);
        const std::set<int>& idx = hf.of(c.format, input);
        const bool grad = is_backward_stage(input);
        for (int h = 0; h < total; ++h) {
            if (idx.count(h)) continue;
            if (grad)
                fail(kExitBadInput, c.file(input, h) + ": missing (" + why_grad_needed(grad_flagged) + ")",
                     std::string("regenerate the case with `attnstep generate --backward`, or ") +
                         (grad_flagged ? "remove backward = true from manifest.toml" : "remove the dO files"));
            fail(kExitBadInput, c.file(input, h) + ": missing (the case has " + count_word + ")",
                 from_manifest ? "regenerate the case, or fix batch/heads in manifest.toml"
                               : "every head needs Q_head_i, K_head_i and V_head_i");
        }
        if (!idx.empty() && *idx.rbegin() >= total) {
            int extra = *idx.rbegin();
            // What the count was taken from: the K files for grouped K/V heads, else the Q files.
            const Stage lead = is_kv_stage(input) && c.dims.kv() != c.dims.heads ? Stage::K : Stage::Q;
            std::string why = from_manifest ? "beyond " + count_word
                              : input == lead ? "but " + std::string(stage_name(lead)) + "_head_" + std::to_string(total) +
                                                    " is missing (a gap)"
                                              : std::string("without a matching ") + stage_name(lead) +
                                                    " file (the case has " + count_word + ")";
            fail(kExitBadInput, c.file(input, extra) + ": exists " + why,
                 "heads are numbered 0..batch*heads-1 with no gaps; remove stray files");
        }
    }
}

// The manifest key of a shape symbol.
const char* sym_key(Sym s) {
    switch (s) {
        case Sym::N: return "seq_q";
        case Sym::M: return "seq_k";
        case Sym::DK: return "d_k";
        case Sym::DV: return "d_v";
        case Sym::ONE: return "1";
        case Sym::S_DV: return "splits·d_v";
        case Sym::S: return "splits";
    }
    return "?";
}

std::string shape_words(Stage s) {
    return std::string(sym_key(stage_info(s).rows)) + " x " + sym_key(stage_info(s).cols);
}

// A Q/K/V head file of the other format beside the case's: ambiguous (which one is meant?), so an
// error, as in the verifier.
void check_no_other_format(const InputCase& c, const HeadFiles& hf) {
    const Format other = c.format == Format::txt ? Format::npy : Format::txt;
    for (Stage input : input_stages()) {
        const std::set<int>& idx = hf.of(other, input);
        if (!idx.empty())
            fail(kExitBadInput, join(c.dir, head_file_name(input, *idx.begin(), other)) + ": a ." +
                                    format_name(other) + " file in a ." + format_name(c.format) + " case",
                 "a case holds one format; remove the stray file");
    }
}

// Every head's text files are regular files whose sizes can hold their shapes: checked before any
// buffer is sized from the dimensions, so a manifest with huge dimensions fails on its files first.
void check_text_file_sizes(const InputCase& c, const std::string& origin) {
    for (Stage s : c.inputs())
        for (int h = 0; h < heads_of(s, c.dims); ++h) {
            const std::string path = c.file(s, h);
            check_text_file_size(path, regular_file_size(path), stage_rows(s, c.dims), stage_cols(s, c.dims),
                                 shape_words(s) + origin);
        }
}

void check_shape(const std::string& path, MatrixShape got, int rows, int cols, const std::string& what,
                 bool from_manifest) {
    if (got.rows == rows && got.cols == cols) return;
    fail(kExitBadInput, path + ": holds " + std::to_string(got.rows) + " x " + std::to_string(got.cols) +
                            " values but " + (from_manifest ? "the manifest says " : "head 0 says ") + what +
                            " = " + std::to_string(rows) + " x " + std::to_string(cols),
         from_manifest ? "regenerate the case, or fix manifest.toml" : "every head must have the same shapes");
}

// Without a manifest the dimensions come from head 0's shapes, and a .npy may hold a 0 x n or
// n x 0 array; every dimension must be >= 1 (no stage is computed for an empty matrix).
void check_inferred_dims_positive(const InputCase& c, MatrixShape q, MatrixShape k, MatrixShape v) {
    const std::pair<Stage, MatrixShape> shapes[] = {{Stage::Q, q}, {Stage::K, k}, {Stage::V, v}};
    for (const auto& [s, got] : shapes)
        if (got.rows < 1 || got.cols < 1)
            fail(kExitBadInput, c.file(s, 0) + ": holds an empty " + std::to_string(got.rows) + " x " +
                                    std::to_string(got.cols) + " array (" + shape_words(s) +
                                    "); every dimension must be >= 1",
                 "Q, K and V need at least one row and one column each");
}

}  // namespace

std::string head_file_name(Stage s, int head, Format fmt, int seq) {
    return stage_file_name(stage_name(s), head, format_name(fmt), seq);
}

std::string InputCase::file(Stage input, int head) const {
    return join(dir, head_file_name(input, head, format));
}

std::vector<Stage> InputCase::inputs() const {
    std::vector<Stage> v;
    for (Stage s : input_stages())
        if (backward || !is_backward_stage(s)) v.push_back(s);
    return v;
}

namespace {

// How many of 0, 1, 2, ... are in `idx` before the first gap.
int run_length(const std::set<int>& idx) {
    int n = 0;
    while (idx.count(n)) ++n;
    return n;
}

// A case without a manifest has as many K/V heads as K files (K_head_0.. with no gaps): fewer than
// Q files is grouped-query attention, and then they must divide the query heads.
int infer_kv_heads(const InputCase& c, const HeadFiles& hf) {
    const int heads = c.dims.heads, kv = run_length(hf.of(c.format, Stage::K));
    if (kv == 0 || kv >= heads) return heads;  // a missing K_head_0 or a stray K file: check_head_files says
    if (heads % kv != 0)
        fail(kExitBadInput, c.file(Stage::K, kv) + ": missing (the case has " + plural(heads, "head") + ", Q_head_0.." +
                                std::to_string(heads - 1) + "; its " + std::to_string(kv) + " K files are grouped K/V "
                                "heads only if that number divides the heads)",
             "every head needs Q_head_i, K_head_i and V_head_i, or the K/V files of a number of K/V heads "
             "that divides the heads (manifest.toml's kv_heads says it outright)");
    return kv;
}

// A case without a manifest: its format, heads and dimensions from the files (head 0's shapes),
// checked as a manifest's would be.
void infer_case_from_files(InputCase& c, const HeadFiles& hf) {
    c.format = detect_format(c.dir, hf);
    c.dims.batch = 1;
    c.dims.heads = run_length(hf.of(c.format, Stage::Q));
    c.dims.kv_heads = infer_kv_heads(c, hf);
    c.backward = decide_backward(c, hf, nullptr);
    check_head_files(c, hf, false, false);
    MatrixShape q = probe_matrix_shape(c.file(Stage::Q, 0), c.format);
    MatrixShape k = probe_matrix_shape(c.file(Stage::K, 0), c.format);
    MatrixShape v = probe_matrix_shape(c.file(Stage::V, 0), c.format);
    c.dims.N = q.rows;
    c.dims.dk = q.cols;
    c.dims.M = k.rows;
    c.dims.dv = v.cols;
    check_inferred_dims_positive(c, q, k, v);
    if (k.cols != q.cols)
        fail(kExitBadInput, c.file(Stage::K, 0) + ": rows hold " + std::to_string(k.cols) +
                                " values but Q_head_0's hold " + std::to_string(q.cols) + " (d_k)",
             "Q and K need the same width d_k");
    if (v.rows != k.rows)
        fail(kExitBadInput, c.file(Stage::V, 0) + ": has " + std::to_string(v.rows) +
                                " rows but K_head_0 has " + std::to_string(k.rows) + " (seq_k)",
             "K and V need the same number of rows seq_k");
    for (Stage s : {Stage::Q, Stage::V}) {
        int w = s == Stage::Q ? c.dims.dk : c.dims.dv;
        if (w > kMaxHeadDim)
            fail(kExitBadInput, c.file(s, 0) + ": rows hold " + std::to_string(w) + " values; " +
                                    (s == Stage::Q ? "d_k" : "d_v") + " must be <= " +
                                    std::to_string(kMaxHeadDim),
                 "head dimensions are 1.." + std::to_string(kMaxHeadDim));
    }
    for (const DimKey& k : kDimKeys)
        if (c.dims.*k.field > kMaxDim)
            fail(kExitBadInput, c.file(Stage::Q, 0) + ": head 0 gives " + k.key + " = " +
                                    std::to_string(c.dims.*k.field) + "; dimensions are 1.." + std::to_string(kMaxDim));
    check_case_limits(c.dir, c.dims, c.backward, c.variant.dropout > 0.f);
}

// Before anything is written: every text file's size, then head 0 read strictly (line-exact
// errors when the manifest and the files disagree; values are checked again when the head is
// read for real); every .npy header (one small read per file, and the file's exact size).
// Later text heads are checked as read.
void check_input_files(const InputCase& c) {
    if (c.format == Format::txt) {
        const char* origin = c.has_manifest ? " from the manifest" : " from head 0";
        check_text_file_sizes(c, origin);
        std::vector<float> scratch;
        for (Stage s : c.inputs()) {
            scratch.resize(stage_elems(s, c.dims));
            read_matrix(c.file(s, 0), c.format, stage_rows(s, c.dims), stage_cols(s, c.dims), true,
                        shape_words(s) + origin, scratch.data());
        }
    } else {
        for (Stage s : c.inputs())
            for (int h = 0; h < heads_of(s, c.dims); ++h)
                check_shape(c.file(s, h), probe_matrix_shape(c.file(s, h), c.format), stage_rows(s, c.dims),
                            stage_cols(s, c.dims), shape_words(s), c.has_manifest || h > 0);
    }
}

}  // namespace

// Dimensions each within their range can still make a case too large (stages.h).
void check_case_limits(const std::string& where, const Dims& d, bool backward, bool dropout) {
    std::string why = case_limit_violation(d, backward, dropout);
    if (!why.empty())
        fail(kExitBadInput, where + ": the case is too large: " + why,
             "split the work into smaller cases (fewer heads or shorter sequences)");
}

InputCase open_input_case(const std::string& dir_in) {
    InputCase c;
    c.dir = dir_in;
    while (c.dir.size() > 1 && c.dir.back() == '/') c.dir.pop_back();
    std::error_code ec;
    if (!fs::is_directory(c.dir, ec))
        fail(kExitBadInput, c.dir + ": input folder not found",
             "generate a case with `attnstep generate`, or pass --in DIR");
    std::string manifest_path = join(c.dir, kInputManifestName);
    c.has_manifest = fs::exists(manifest_path, ec);
    HeadFiles hf = list_head_files(c.dir);
    std::optional<Manifest> m;
    if (c.has_manifest) {
        m = read_manifest(manifest_path);
        apply_input_manifest(*m, &c);
        check_packed_manifest(c, *m);
        if (!m->find("format")) c.format = detect_format(c.dir, hf);
        c.backward = decide_backward(c, hf, &*m);
        check_case_limits(m->path, c.dims, c.backward, c.variant.dropout > 0.f);
        check_head_files(c, hf, true, m->find("backward") != nullptr);
    } else {
        infer_case_from_files(c, hf);
    }
    check_no_other_format(c, hf);
    check_sequence_files(&c, m ? &*m : nullptr);
    check_input_files(c);
    check_variant_files(&c);
    return c;
}

void read_input(const InputCase& c, Stage input, int head, bool allow_nonfinite, float* dst) {
    const char* origin = c.has_manifest ? " from the manifest" : " from head 0";
    read_matrix(c.file(input, head), c.format, stage_rows(input, c.dims), stage_cols(input, c.dims), allow_nonfinite,
                shape_words(input) + origin, dst);
    // A decode step: the cache after its new keys are written, what every stage reads and K, V echo.
    if (c.sequences.new_keys > 0 && (input == Stage::K || input == Stage::V))
        append_new_keys(c, input, head, allow_nonfinite, dst);
}

}  // namespace attnstep
