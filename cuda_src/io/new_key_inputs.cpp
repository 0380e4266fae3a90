// new_key_inputs.cpp — a decode step's new keys; see new_key_inputs.h.
#include "new_key_inputs.h"

#include <algorithm>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "../common.h"
#include "../sequences.h"
#include "input_manifest.h"
#include "matrix_io.h"

namespace fs = std::filesystem;

namespace attnstep {

namespace {

const char* input_name(Stage input) { return input == Stage::K ? kNewKeysInput : kNewValuesInput; }

std::string new_key_file(Stage input, int head, Format fmt) {
    return std::string(input_name(input)) + "_head_" + std::to_string(head) + "." + format_name(fmt);
}

// The new-key files in the folder (either format; the head a number without leading zeros), sorted.
std::vector<std::string> new_key_files(const std::string& dir) {
    std::vector<std::string> found;
    std::error_code ec;
    for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
        const std::string name = e.path().filename().string();
        for (const char* input : {kNewKeysInput, kNewValuesInput}) {
            const std::string prefix = std::string(input) + "_head_";
            const size_t dot = name.rfind('.');
            if (name.compare(0, prefix.size(), prefix) != 0 || dot == std::string::npos || dot <= prefix.size()) continue;
            const std::string digits = name.substr(prefix.size(), dot - prefix.size()), ext = name.substr(dot + 1);
            bool number = digits.size() == 1 || digits[0] != '0';
            for (char ch : digits) number = number && ch >= '0' && ch <= '9';
            if (number && (ext == "txt" || ext == "npy")) found.push_back(name);
        }
    }
    std::sort(found.begin(), found.end());
    return found;
}

// The first dO file of the case's format (as the Python reader names it), or "".
std::string first_grad_file(const InputCase& c) {
    return c.backward ? c.file(Stage::dO, 0) : "";
}

// K/V head `head`'s new keys (or values), (B * n) x d, into *dst.
void read_new_keys(const InputCase& c, Stage input, int head, bool allow_nonfinite, std::vector<float>* dst) {
    const int rows = c.sequences.count() * c.sequences.new_keys, cols = stage_cols(input, c.dims);
    dst->resize(static_cast<size_t>(rows) * cols);
    read_matrix(c.dir + "/" + new_key_file(input, head, c.format), c.format, rows, cols, allow_nonfinite,
                std::string(kSequencesKey) + " * " + kNewKeysKey + " x " + (input == Stage::K ? "d_k" : "d_v") +
                    " from the manifest",
                dst->data());
}

}  // namespace

void check_new_keys_manifest(const Manifest& m) {
    const ManifestValue* n = m.find(kNewKeysKey);
    if (!n) return;
    if (!m.find(kSequencesKey)) fail(kExitBadInput, m.where(kNewKeysKey) + ": " + new_keys_unpacked_problem(n->i));
    if (n->i < 1 || n->i > kMaxTokens) fail(kExitBadInput, m.where(kNewKeysKey) + ": " + new_keys_count_problem(n->i));
}

void check_new_key_files(InputCase* c, const Manifest* m) {
    const std::vector<std::string> files = new_key_files(c->dir);
    const ManifestValue* n = m ? m->find(kNewKeysKey) : nullptr;
    if (!m) {
        if (!files.empty()) fail(kExitBadInput, c->dir + "/" + files[0] + ": " + kNewKeysNoManifest, kNewKeysNoManifestHint);
        return;
    }
    if (!n) {
        if (!files.empty())
            fail(kExitBadInput, c->dir + "/" + files[0] + ": " + kNotAppended + " (no " + kNewKeysKey + " = n in " +
                                    kInputManifestName + ")",
                 kNotAppendedHint);
        return;
    }
    if (c->backward) {
        const std::string where = m->find("backward") ? m->where("backward") + ": backward = true" : first_grad_file(*c);
        fail(kExitBadInput, where + ": " + kNewKeysBackward, kNewKeysBackwardHint);
    }
    Sequences& s = c->sequences;
    const std::string fmt = format_name(c->format);
    if (s.used_k.empty())
        fail(kExitBadInput, c->dir + "/" + kSequsedK + "." + fmt + ": missing file (" + kNewKeysNeedSequsedK + ")");
    const std::string problem = new_keys_problem(s, n->i);
    if (!problem.empty()) {
        const char* file = problem.compare(0, 9, kSequsedK) == 0 ? kSequsedK
                           : problem.compare(0, 12, kCuSeqlensQ) == 0 ? kCuSeqlensQ : kBlockTable;
        fail(kExitBadInput, c->dir + "/" + file + "." + fmt + ": " + problem);
    }
    const int kv_heads = c->dims.total_kv_heads();
    for (int j = 0; j < kv_heads; ++j)
        for (Stage input : {Stage::K, Stage::V}) {
            const std::string name = new_key_file(input, j, c->format);
            if (!std::binary_search(files.begin(), files.end(), name))
                fail(kExitBadInput, c->dir + "/" + name + ": missing file (" + kInputManifestName + " says " + kNewKeysKey +
                                        " = " + std::to_string(n->i) + ")");
        }
    for (const std::string& name : files) {
        bool wanted = false;
        for (int j = 0; j < kv_heads && !wanted; ++j)
            wanted = name == new_key_file(Stage::K, j, c->format) || name == new_key_file(Stage::V, j, c->format);
        if (wanted) continue;
        const std::string ext = name.substr(name.rfind('.') + 1);
        if (ext != fmt)
            fail(kExitBadInput, c->dir + "/" + name + ": a ." + ext + " file in a ." + fmt + " case",
                 "a case holds one format; remove the stray file");
        fail(kExitBadInput, c->dir + "/" + name + ": unexpected file: the case has " + plural(kv_heads, "K/V head") + " (0.." +
                                std::to_string(kv_heads - 1) + ")");
    }
    for (long long& u : s.used_k) u += n->i;
    s.new_keys = static_cast<int>(n->i);
    // Small (n rows per sequence): read whole now, so that a bad one is refused before OUT is touched.
    std::vector<float> scratch;
    for (int j = 0; j < kv_heads; ++j)
        for (Stage input : {Stage::K, Stage::V}) read_new_keys(*c, input, j, true, &scratch);
}

void append_new_keys(const InputCase& c, Stage input, int head, bool allow_nonfinite, float* pool) {
    const Sequences& s = c.sequences;
    const int cols = stage_cols(input, c.dims);
    std::vector<float> added;
    read_new_keys(c, input, head, allow_nonfinite, &added);
    for (int b = 0; b < s.count(); ++b)
        for (int t = 0; t < s.new_keys; ++t)
            std::copy_n(added.data() + (static_cast<size_t>(b) * s.new_keys + t) * cols, cols,
                        pool + static_cast<size_t>(s.key_row(b, s.cache_len(b) + t)) * cols);
}

}  // namespace attnstep
