// variant_inputs.cpp — the variant's input files; see variant_inputs.h.
#include "variant_inputs.h"

#include <cmath>
#include <fstream>
#include <filesystem>
#include <set>
#include <system_error>

#include "../common.h"
#include "input_file.h"
#include "input_manifest.h"
#include "variant_manifest.h"

namespace fs = std::filesystem;

namespace attnstep {

namespace {

const Format kFormats[] = {Format::txt, Format::npy};

// A slopes file in a run without ALiBi (which would ignore it): the words after the file's path,
// and the hint. verify/files/variant_inputs.py UNUSED_SLOPES is the verifier's twin.
const std::string kUnusedSlopes[] = {
    "exists but the run has no ALiBi (its slopes would be unused)",
    std::string("turn ALiBi on to use them (alibi = true in ") + kInputManifestName + ", or --alibi), or remove the file"};

// "<name>_head_<i>.<fmt>" (head >= 0) or "<name>.<fmt>" (head < 0: the broadcast file).
std::string file_name(const char* name, int head, Format fmt) {
    return std::string(name) + (head >= 0 ? "_head_" + std::to_string(head) : "") + "." + format_name(fmt);
}

std::string file_path(const InputCase& c, const char* name, int head, Format fmt) {
    return c.dir + "/" + file_name(name, head, fmt);
}

// The files of a mask or bias in the case folder, per format: the head numbers of its per-head
// files (as the binary writes head numbers: digits, no leading zero) and whether its broadcast
// file exists.
struct TensorFiles {
    std::set<int> heads[2];
    bool broadcast[2] = {false, false};
    bool any(Format f) const { return broadcast[static_cast<int>(f)] || !heads[static_cast<int>(f)].empty(); }
};

TensorFiles list_tensor_files(const std::string& dir, const char* name) {
    TensorFiles tf;
    const std::string prefix = std::string(name) + "_head_";
    std::error_code ec;
    for (const fs::directory_entry& e : fs::directory_iterator(dir, ec))
        for (Format f : kFormats) {
            const std::string file = e.path().filename().string(), ext = std::string(".") + format_name(f);
            const int fi = static_cast<int>(f);
            if (file == name + ext) tf.broadcast[fi] = true;
            if (file.size() <= prefix.size() + ext.size() || file.compare(0, prefix.size(), prefix) ||
                file.compare(file.size() - ext.size(), ext.size(), ext))
                continue;
            const std::string num = file.substr(prefix.size(), file.size() - prefix.size() - ext.size());
            if (!num.empty() && num.size() <= 9 && num.find_first_not_of("0123456789") == std::string::npos &&
                (num.size() == 1 || num[0] != '0'))
                tf.heads[fi].insert(std::stoi(num));
        }
    if (ec) fail(kExitBadInput, dir + ": cannot list the folder: " + ec.message());
    return tf;
}

// What a value of each input may be: a mask keeps (1) or hides (0); a bias adds any number or
// -inf (hides the entry, as PyTorch's float attn_mask), never +inf or NaN; a slope is finite.
enum class ValueRule { mask, bias, slope };

// Where matrix element (r, c) (0-based) is, in verify/files/matrix_io.py element_where's words: in a
// text file line:col (its line, comments counted; its value, 1-based), in an .npy row r, col c.
std::string element_where(const std::string& path, size_t r, size_t c) {
    const std::string ext = ".txt";
    if (path.size() < ext.size() || path.compare(path.size() - ext.size(), ext.size(), ext))
        return "row " + std::to_string(r) + ", col " + std::to_string(c);
    std::ifstream in(path, std::ios::binary);
    std::string line;
    size_t row = 0;
    for (int line_no = 1; std::getline(in, line); ++line_no) {
        const size_t first = line.find_first_not_of(" \t\r\v\f");
        if (first == std::string::npos || line[first] == '#') continue;
        if (row++ == r) return std::to_string(line_no) + ":" + std::to_string(c + 1);
    }
    return "row " + std::to_string(r) + ", col " + std::to_string(c);
}

std::string value_text(float x) {
    if (std::isnan(x)) return "nan";
    if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
    char value[32];
    std::snprintf(value, sizeof value, "%.9g", static_cast<double>(x));
    return value;
}

// The words of verify/files/variant_inputs.py's _refuse: the first bad value at file:line:col, how
// many there are, and the rule (as the hint).
void check_values(const std::string& path, ValueRule rule, const float* data, int rows, int cols) {
    static const char* const kWhat[] = {"a mask", "a bias", "the ALiBi slopes"};
    static const char* const kWhy[] = {"a mask holds 0 (hidden) or 1 (visible) only; additive values go in a bias file",
                                       "a bias holds finite values or -inf (which hides the entry), never +inf or NaN",
                                       "slopes must be finite numbers"};
    const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(cols);
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; ++i) {
        const float x = data[i];
        const bool ok = rule == ValueRule::mask   ? (x == 0.f || x == 1.f)
                        : rule == ValueRule::bias ? !(std::isnan(x) || x == INFINITY)
                                                  : std::isfinite(x);
        if (!ok && !bad++) first = i;
    }
    if (!bad) return;
    const int ri = static_cast<int>(rule);
    fail(kExitBadInput, path + ":" + element_where(path, first / cols, first % cols) + ": " + value_text(data[first]) +
                            " in " + kWhat[ri] + " (" + std::to_string(bad) + (bad == 1 ? " such value)" : " such values)"),
         kWhy[ri]);
}

// Reads a matrix of the variant's inputs and checks its values (NaN and Inf are read, then judged
// by the input's own rule, whatever --allow-nonfinite says).
void read_checked(const std::string& path, Format fmt, int rows, int cols, const std::string& what, ValueRule rule,
                  float* dst) {
    read_matrix(path, fmt, rows, cols, true, what, dst);
    check_values(path, rule, dst, rows, cols);
}

std::string nm_words(const InputCase& c) {
    return std::string("seq_q x seq_k") + (c.has_manifest ? " from the manifest" : " from head 0");
}

// Without a manifest a mask or bias is what its files are: per head, broadcast, or none.
Coverage infer_coverage(const InputCase& c, const char* name, const TensorFiles& tf) {
    const int fi = static_cast<int>(c.format);
    if (tf.broadcast[fi] && !tf.heads[fi].empty())
        fail(kExitBadInput, c.dir + ": both " + file_name(name, -1, c.format) + " and " +
                                file_name(name, *tf.heads[fi].begin(), c.format) + " exist",
             std::string("a ") + name + " is per head or broadcast over the heads; remove one, or say which in "
             "manifest.toml (" + name + " = \"per-head\" or \"broadcast\")");
    return tf.broadcast[fi] ? Coverage::broadcast : tf.heads[fi].empty() ? Coverage::none : Coverage::per_head;
}

// A file the case does not declare: the other format's, or another coverage's.
void check_no_stray_file(const InputCase& c, const char* name, Coverage cov, const TensorFiles& tf) {
    const Format other = c.format == Format::txt ? Format::npy : Format::txt;
    if (tf.any(other)) {
        const int oi = static_cast<int>(other);
        const int head = tf.broadcast[oi] ? -1 : *tf.heads[oi].begin();
        fail(kExitBadInput, file_path(c, name, head, other) + ": a ." + format_name(other) + " file in a ." +
                                format_name(c.format) + " case",
             "a case holds one format; remove the stray file");
    }
    const int fi = static_cast<int>(c.format);
    const bool stray_broadcast = tf.broadcast[fi] && cov != Coverage::broadcast;
    const bool stray_head = !tf.heads[fi].empty() && cov != Coverage::per_head;
    if (!stray_broadcast && !stray_head) return;
    fail(kExitBadInput, file_path(c, name, stray_broadcast ? -1 : *tf.heads[fi].begin(), c.format) +
                            ": exists but the manifest says " + name + " = " + coverage_name(cov),
         std::string("remove the file, or set ") + name + " = \"" +
             coverage_name(stray_broadcast ? Coverage::broadcast : Coverage::per_head) + "\" in manifest.toml");
}

// The declared files exist, and no per-head file beyond the heads; their sizes (text) or shapes
// (npy) hold N×M; head 0's (or the broadcast file's) values are read strictly.
void check_declared_files(const InputCase& c, const char* name, Coverage cov, const TensorFiles& tf, ValueRule rule) {
    if (cov == Coverage::none) return;
    const Dims& d = c.dims;
    const int files = cov == Coverage::per_head ? d.total_heads() : 1;
    const std::string why = std::string(c.has_manifest ? "the manifest says " : "the case has ") + name + " = " +
                            coverage_name(cov) + (cov == Coverage::per_head ? ": one file per query head" : "");
    for (int h = 0; h < files; ++h) {
        const std::string path = file_path(c, name, cov == Coverage::per_head ? h : -1, c.format);
        if (cov == Coverage::per_head && !tf.heads[static_cast<int>(c.format)].count(h))
            fail(kExitBadInput, path + ": missing (" + why + ", batch*heads = " + std::to_string(d.total_heads()) + ")",
                 std::string("write ") + name + "_head_<i> for every head i, or one " + name + " file broadcast (" +
                     name + " = \"broadcast\")");
        if (cov == Coverage::broadcast && !tf.broadcast[static_cast<int>(c.format)])
            fail(kExitBadInput, path + ": missing (" + why + ")",
                 std::string("write the file, or set ") + name + " = \"none\" in manifest.toml");
        if (c.format == Format::txt) {
            check_text_file_size(path, regular_file_size(path), d.N, d.M, nm_words(c));
        } else {
            const MatrixShape got = probe_matrix_shape(path, c.format);
            if (got.rows != d.N || got.cols != d.M)
                fail(kExitBadInput, path + ": holds " + std::to_string(got.rows) + " x " + std::to_string(got.cols) +
                                        " values; expected " + std::to_string(d.N) + " x " + std::to_string(d.M) +
                                        " (" + nm_words(c) + ")",
                     "a mask or bias has one value per query row and key");
        }
    }
    const std::set<int>& heads = tf.heads[static_cast<int>(c.format)];
    if (cov == Coverage::per_head && !heads.empty() && *heads.rbegin() >= d.total_heads())
        fail(kExitBadInput, file_path(c, name, *heads.rbegin(), c.format) + ": exists beyond the case's batch*heads = " +
                                std::to_string(d.total_heads()),
             "heads are numbered 0..batch*heads-1; remove stray files");
    std::vector<float> head0(static_cast<size_t>(d.N) * static_cast<size_t>(d.M));
    read_checked(file_path(c, name, cov == Coverage::per_head ? 0 : -1, c.format), c.format, d.N, d.M, nm_words(c),
                 rule, head0.data());
}

// The slopes file's shape: one row of `heads` slopes (every batch element) or `batch` rows.
MatrixShape check_slopes_shape(const std::string& path, const InputCase& c) {
    const MatrixShape got = probe_matrix_shape(path, c.format);
    const Dims& d = c.dims;
    if (got.cols != d.heads || (got.rows != 1 && got.rows != d.batch))
        fail(kExitBadInput, path + ": holds " + std::to_string(got.rows) + " x " + std::to_string(got.cols) +
                                " values; expected 1 x " + std::to_string(d.heads) +
                                (d.batch > 1 ? " or " + std::to_string(d.batch) + " x " + std::to_string(d.heads) : "") +
                                " (one slope per head, in one row for every batch element or a row each)",
             "write the slopes of heads 0..heads-1 in a row");
    return got;
}

}  // namespace

void check_variant_files(InputCase* c) {
    const struct {
        const char* name;
        Coverage* cov;
        ValueRule rule;
    } inputs[] = {{kMaskInput, &c->variant.mask, ValueRule::mask}, {kBiasInput, &c->variant.bias, ValueRule::bias}};
    for (const auto& in : inputs) {
        const TensorFiles tf = list_tensor_files(c->dir, in.name);
        if (!c->has_manifest) *in.cov = infer_coverage(*c, in.name, tf);
        check_no_stray_file(*c, in.name, *in.cov, tf);
        check_declared_files(*c, in.name, *in.cov, tf, in.rule);
    }
    for (Format f : kFormats) {
        const std::string path = file_path(*c, kAlibiSlopesInput, -1, f);
        std::error_code ec;
        if (!fs::exists(path, ec)) continue;
        if (f != c->format)
            fail(kExitBadInput, path + ": a ." + format_name(f) + " file in a ." + format_name(c->format) + " case",
                 "a case holds one format; remove the stray file");
        check_slopes_shape(path, *c);
        c->has_slopes_file = true;
    }
}

VariantInputs::VariantInputs(const InputCase& c, const Problem& p) : c_(c), v_(p.variant) {
    const Dims& d = c.dims;
    const size_t nm = static_cast<size_t>(d.N) * static_cast<size_t>(d.M);
    if (v_.mask == Coverage::broadcast) {
        mask_.resize(nm);
        read_checked(file_path(c, kMaskInput, -1, c.format), c.format, d.N, d.M, nm_words(c), ValueRule::mask, mask_.data());
    }
    if (v_.bias == Coverage::broadcast) {
        bias_.resize(nm);
        read_checked(file_path(c, kBiasInput, -1, c.format), c.format, d.N, d.M, nm_words(c), ValueRule::bias, bias_.data());
    }
    const std::string slopes_path = file_path(c, kAlibiSlopesInput, -1, c.format);
    if (c.has_slopes_file && !v_.alibi)  // (ALiBi as the manifest and --alibi say: p.variant)
        fail(kExitBadInput, slopes_path + ": " + kUnusedSlopes[0], kUnusedSlopes[1]);
    if (!v_.alibi) return;
    slopes_.resize(static_cast<size_t>(d.total_heads()));
    for (int h = 0; h < d.total_heads(); ++h) slopes_[h] = static_cast<float>(alibi_slope(h % d.heads, d.heads));
    if (!c.has_slopes_file) return;
    const MatrixShape shape = check_slopes_shape(slopes_path, c);
    std::vector<float> file(static_cast<size_t>(shape.rows) * shape.cols);
    read_checked(slopes_path, c.format, shape.rows, shape.cols, "1 or batch rows of heads slopes", ValueRule::slope,
                 file.data());
    for (int h = 0; h < d.total_heads(); ++h) slopes_[h] = file[shape.rows == 1 ? h % d.heads : h];
}

void VariantInputs::read_group(HeadGroup& g) {
    const Dims& d = c_.dims;
    const size_t nm = static_cast<size_t>(d.N) * static_cast<size_t>(d.M);
    const struct {
        Coverage cov;
        const char* name;
        ValueRule rule;
        std::vector<float>& buf;
        const float** ptr;
        long long* stride;
    } inputs[] = {{v_.mask, kMaskInput, ValueRule::mask, mask_, &g.mask, &g.mask_head_stride},
                  {v_.bias, kBiasInput, ValueRule::bias, bias_, &g.bias, &g.bias_head_stride}};
    for (const auto& in : inputs) {
        *in.ptr = in.cov == Coverage::none ? nullptr : in.buf.data();
        *in.stride = in.cov == Coverage::per_head ? static_cast<long long>(nm) : 0;
        if (in.cov != Coverage::per_head) continue;
        in.buf.resize(nm * static_cast<size_t>(g.count));
        *in.ptr = in.buf.data();
        for (int j = 0; j < g.count; ++j)
            read_checked(file_path(c_, in.name, g.first + j, c_.format), c_.format, d.N, d.M, nm_words(c_), in.rule,
                         in.buf.data() + nm * j);
    }
    g.alibi_slopes = slopes_.empty() ? nullptr : slopes_.data() + g.first;
}

}  // namespace attnstep
