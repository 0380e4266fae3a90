// case_layout.cpp — finding and checking input/output case folders; see case_layout.h.
#include "case_layout.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <sys/stat.h>
#include <system_error>
#include <utility>
#include <vector>

#include "../backend.h"
#include "../common.h"
#include "atomic_file.h"
#include "input_file.h"
#include "manifest.h"
#include "run_folder.h"

namespace fs = std::filesystem;

namespace attnstep {

namespace {

const char* kManifestName = "manifest.toml";

std::string join(const std::string& dir, const std::string& name) { return dir + "/" + name; }

// ------------------------------------------------------------ manifest keys
enum class KeyType { Int, Float, Bool, String };
struct KeySpec {
    const char* key;
    KeyType type;
};
const KeySpec kManifestKeys[] = {
    {"batch", KeyType::Int},  {"heads", KeyType::Int},   {"seq_q", KeyType::Int},
    {"seq_k", KeyType::Int},  {"d_k", KeyType::Int},     {"d_v", KeyType::Int},
    {"causal", KeyType::Bool}, {"scale", KeyType::Float}, {"format", KeyType::String},
    {"seed", KeyType::Int},   {"distribution", KeyType::String}, {"generator", KeyType::String},
    {"backward", KeyType::Bool},
};

std::string known_keys() {
    std::string s;
    for (const KeySpec& k : kManifestKeys) s += (s.empty() ? "" : " ") + std::string(k.key);
    return s;
}

bool type_matches(const ManifestValue& v, KeyType t) {
    switch (t) {
        case KeyType::Int: return v.kind == ManifestValue::Int;
        case KeyType::Float: return v.kind == ManifestValue::Float || v.kind == ManifestValue::Int;
        case KeyType::Bool: return v.kind == ManifestValue::Bool;
        case KeyType::String: return v.kind == ManifestValue::String;
    }
    return false;
}

const char* type_word(KeyType t) {
    switch (t) {
        case KeyType::Int: return "an integer";
        case KeyType::Float: return "a number";
        case KeyType::Bool: return "true or false";
        case KeyType::String: return "a double-quoted string";
    }
    return "?";
}

void check_manifest_keys(const Manifest& m) {
    for (const auto& kv : m.values) {
        const KeySpec* spec = nullptr;
        for (const KeySpec& k : kManifestKeys)
            if (kv.first == k.key) spec = &k;
        if (!spec)
            fail(kExitBadInput, m.path + ":" + std::to_string(m.key_lines.at(kv.first)) +
                                    ":1: unknown key '" + kv.first + "'",
                 "known keys: " + known_keys());
        if (!type_matches(kv.second, spec->type))
            fail(kExitBadInput, m.where(kv.first) + ": '" + kv.first + "' must be " +
                                    type_word(spec->type));
    }
}

// Dimensions each within their range can still make a case too large (stages.h).
void check_case_limits(const std::string& where, const Dims& d, bool backward) {
    std::string why = case_limit_violation(d, backward);
    if (!why.empty())
        fail(kExitBadInput, where + ": the case is too large: " + why,
             "split the work into smaller cases (fewer heads or shorter sequences)");
}

void apply_manifest(const Manifest& m, InputCase* c) {
    check_manifest_keys(m);
    std::string all_dim_keys;
    for (const DimKey& k : kDimKeys) all_dim_keys += (all_dim_keys.empty() ? "" : " ") + std::string(k.key);
    for (const DimKey& k : kDimKeys) {
        const ManifestValue* v = m.find(k.key);
        if (!v)
            fail(kExitBadInput, m.path + ": missing key '" + std::string(k.key) + "'",
                 "a manifest names all of " + all_dim_keys);
        if (v->i < 1 || v->i > kMaxDim)
            fail(kExitBadInput, m.where(k.key) + ": " + k.key + " = " + std::to_string(v->i) +
                                    " is out of range (dimensions are 1.." + std::to_string(kMaxDim) + ")");
        c->dims.*k.field = static_cast<int>(v->i);
    }
    for (const char* k : {"d_k", "d_v"})
        if (m.find(k)->i > kMaxHeadDim)
            fail(kExitBadInput, m.where(k) + ": " + k + " = " + std::to_string(m.find(k)->i) +
                                    " exceeds " + std::to_string(kMaxHeadDim),
                 "head dimensions are 1.." + std::to_string(kMaxHeadDim));
    if (const ManifestValue* v = m.find("causal")) c->causal = v->b;
    if (const ManifestValue* v = m.find("scale")) {
        c->has_scale = true;
        c->scale = v->f;
        if (!scale_fits_float32(v->f))
            fail(kExitBadInput, m.where("scale") + ": scale = " + toml_float(v->f) + ": " + kScaleRangeWords);
    }
    if (const ManifestValue* v = m.find("format"))
        if (!parse_format(v->s, &c->format))
            fail(kExitBadInput, m.where("format") + ": format \"" + v->s + "\" is not \"txt\" or \"npy\"");
}

// ------------------------------------------------------------ the folder's head files
// indices[fmt][stage] = the head numbers present, from names "<input>_head_<i>.<txt|npy>" of the
// input stages (Q, K, V, dO).
struct HeadFiles {
    std::set<int> indices[2][kNumStages];
    const std::set<int>& of(Format f, Stage s) const { return indices[static_cast<int>(f)][static_cast<int>(s)]; }
};

// Every input stage of the table, dO included.
std::vector<Stage> all_inputs() {
    std::vector<Stage> v;
    for (int i = 0; i < kNumStages; ++i)
        if (is_input_echo(static_cast<Stage>(i))) v.push_back(static_cast<Stage>(i));
    return v;
}

HeadFiles list_head_files(const std::string& dir) {
    HeadFiles hf;
    std::error_code ec;
    for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
        std::string name = e.path().filename().string();
        for (int fi = 0; fi < 2; ++fi)
            for (Stage input : all_inputs()) {
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

// Every input file for heads 0..total-1 exists, and none beyond.
void check_head_files(const InputCase& c, const HeadFiles& hf, int total, bool from_manifest, bool grad_flagged) {
    std::string count_word = from_manifest ? "the manifest's batch*heads = " + std::to_string(total)
                                           : plural(total, "head") + " (Q_head_0.." +
                                                 std::to_string(total - 1) + " with no gaps)";
    for (Stage input : c.inputs()) {
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
            std::string why = from_manifest ? "beyond " + count_word
                                            : (input == Stage::Q ? "but Q_head_" + std::to_string(total) + " is missing (a gap)"
                                                                 : "without a matching Q file (the case has " + count_word + ")");
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
    for (Stage input : all_inputs()) {
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
    for (int h = 0; h < c.dims.total_heads(); ++h)
        for (Stage s : c.inputs()) {
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

// Compared as files (device and inode), not as paths: a symlink or a bind mount reaches the same
// folder by another path.
bool same_folder(const std::string& a, const std::string& b) {
    struct stat sa, sb;
    return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev &&
           sa.st_ino == sb.st_ino;
}

// What an input case folder holds and an output folder does not: the input manifest, or input
// files (Q, K, V, dO per head) with no run.toml and no other stage beside them (an output folder
// echoes the inputs beside the stages it computed). Empty when `dir` looks like no input case.
std::string input_case_sign(const std::string& dir) {
    if (fs::exists(join(dir, kManifestName))) return kManifestName;
    if (holds_run_traces(dir)) return "";  // a run's folder, whatever a killed run left in it
    std::string input;
    bool other_stage = false;
    std::error_code ec;
    for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
        const std::string name = e.path().filename().string();
        if (name == kRunManifest) return "";
        if (!is_run_file_name(name)) continue;
        const std::string stage = name.substr(0, name.find("_head_"));
        bool is_input = false;
        for (Stage s : all_inputs()) is_input = is_input || stage == stage_name(s);
        if (is_input) input = name;
        else other_stage = true;
    }
    return other_stage ? "" : input;
}

}  // namespace

std::string head_file_name(Stage s, int head, Format fmt) {
    return std::string(stage_name(s)) + "_head_" + std::to_string(head) + "." + format_name(fmt);
}

std::string InputCase::file(Stage input, int head) const {
    return join(dir, head_file_name(input, head, format));
}

std::vector<Stage> InputCase::inputs() const {
    std::vector<Stage> v;
    for (Stage s : all_inputs())
        if (backward || !is_backward_stage(s)) v.push_back(s);
    return v;
}

namespace {

// A case without a manifest: its format, heads and dimensions from the files (head 0's shapes),
// checked as a manifest's would be.
void infer_case_from_files(InputCase& c, const HeadFiles& hf) {
    c.format = detect_format(c.dir, hf);
    int heads = 0;
    while (hf.indices[static_cast<int>(c.format)][0].count(heads)) ++heads;
    c.dims.batch = 1;
    c.dims.heads = heads;
    c.backward = decide_backward(c, hf, nullptr);
    check_head_files(c, hf, heads, false, false);
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
    check_case_limits(c.dir, c.dims, c.backward);
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
        for (int h = 0; h < c.dims.total_heads(); ++h)
            for (Stage s : c.inputs())
                check_shape(c.file(s, h), probe_matrix_shape(c.file(s, h), c.format), stage_rows(s, c.dims),
                            stage_cols(s, c.dims), shape_words(s), c.has_manifest || h > 0);
    }
}

}  // namespace

InputCase open_input_case(const std::string& dir_in) {
    InputCase c;
    c.dir = dir_in;
    while (c.dir.size() > 1 && c.dir.back() == '/') c.dir.pop_back();
    std::error_code ec;
    if (!fs::is_directory(c.dir, ec))
        fail(kExitBadInput, c.dir + ": input folder not found",
             "generate a case with `attnstep generate`, or pass --in DIR");
    std::string manifest_path = join(c.dir, kManifestName);
    c.has_manifest = fs::exists(manifest_path, ec);
    HeadFiles hf = list_head_files(c.dir);
    if (c.has_manifest) {
        Manifest m = read_manifest(manifest_path);
        apply_manifest(m, &c);
        if (!m.find("format")) c.format = detect_format(c.dir, hf);
        c.backward = decide_backward(c, hf, &m);
        check_case_limits(m.path, c.dims, c.backward);
        check_head_files(c, hf, c.dims.total_heads(), true, m.find("backward") != nullptr);
    } else {
        infer_case_from_files(c, hf);
    }
    check_no_other_format(c, hf);
    check_input_files(c);
    return c;
}

void read_head_inputs(const InputCase& c, int head, bool allow_nonfinite, const HeadInputs& in) {
    const char* origin = c.has_manifest ? " from the manifest" : " from head 0";
    const std::pair<Stage, float*> dst[] = {{Stage::Q, in.q}, {Stage::K, in.k}, {Stage::V, in.v}, {Stage::dO, in.dout}};
    for (const auto& [s, buf] : dst) {
        if (!buf) continue;
        read_matrix(c.file(s, head), c.format, stage_rows(s, c.dims), stage_cols(s, c.dims), allow_nonfinite,
                    shape_words(s) + origin, buf);
    }
}

void prepare_output_dir(const std::string& out_dir, const std::string& in_dir, const std::string& run_id) {
    std::error_code ec;
    if (fs::exists(out_dir, ec) && !fs::is_directory(out_dir, ec))
        fail(kExitBadInput, out_dir + ": exists and is not a folder", "pass --out a folder path");
    fs::create_directories(out_dir, ec);
    if (ec || !fs::is_directory(out_dir))
        fail(kExitBadInput, out_dir + ": cannot create the output folder: " +
                                (ec ? ec.message() : std::string("not a folder")),
             "pass --out a folder you can write to");
    if (same_folder(out_dir, in_dir))
        fail(kExitBadInput, out_dir + ": the output folder is the input folder (" + in_dir + ")",
             "outputs would overwrite the inputs; pass a different --out");
    const std::string sign = input_case_sign(out_dir);
    if (!sign.empty())
        fail(kExitBadInput, out_dir + ": holds an input case (" + sign + "), not a run's output",
             "its inputs would be replaced; pass an --out folder of its own");
    // A real write is the only reliable test (permission bits say nothing on read-only mounts or
    // for root).
    std::string probe = temporary_path(join(out_dir, ".attnstep-probe"), run_id);
    FILE* f = std::fopen(probe.c_str(), "wb");
    if (!f)
        fail(kExitBadInput, out_dir + ": the output folder is not writable",
             "pass --out a folder you can write to");
    std::fclose(f);
    std::remove(probe.c_str());
}

}  // namespace attnstep
