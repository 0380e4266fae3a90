// sequence_inputs.cpp — the files of a packed case; see sequence_inputs.h.
#include "sequence_inputs.h"

#include <algorithm>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "../common.h"
#include "../stages.h"
#include "input_manifest.h"
#include "manifest.h"
#include "matrix_io.h"
#include "new_key_inputs.h"
#include "variant_manifest.h"

namespace fs = std::filesystem;

namespace attnstep {

namespace {

const Format kFormats[] = {Format::txt, Format::npy};

std::string file_path(const InputCase& c, const char* name, Format fmt) {
    return c.dir + "/" + name + "." + format_name(fmt);
}

bool exists(const std::string& path) {
    std::error_code ec;
    return fs::exists(path, ec);
}

// Which sequence files the folder holds, in either format.
struct SequenceFiles {
    bool has[kNumSequenceFiles][2] = {};
    bool any(int i) const { return has[i][0] || has[i][1]; }
};

SequenceFiles find_files(const InputCase& c) {
    SequenceFiles f;
    for (int i = 0; i < kNumSequenceFiles; ++i)
        for (Format fmt : kFormats) f.has[i][static_cast<int>(fmt)] = exists(file_path(c, kSequenceFiles[i], fmt));
    return f;
}

// The file that the words of sequences_problem are about: the one whose name starts them.
std::string problem_file(const InputCase& c, const std::string& words) {
    for (const char* name : {kSequsedK, kCuSeqlensQ, kCuSeqlensK, kBlockTable})
        if (words.compare(0, std::string(name).size(), name) == 0) return file_path(c, name, c.format);
    return c.dir;
}

// A case without a manifest has a mask or bias when its files say (`name`, `name`_head_<i>, either
// format); the first such entry by name is the one an error names.
std::string first_tensor_file(const InputCase& c, const char* name) {
    std::vector<std::string> held;
    bool any = false;
    std::error_code ec;
    const std::string prefix = name, head = prefix + "_head_";
    for (const fs::directory_entry& e : fs::directory_iterator(c.dir, ec)) {
        const std::string file = e.path().filename().string();
        const size_t dot = file.rfind('.');
        if (file.compare(0, prefix.size(), prefix) != 0 || dot == std::string::npos) continue;
        const std::string ext = file.substr(dot + 1), stem = file.substr(0, dot);
        if (ext != "txt" && ext != "npy") continue;
        held.push_back(file);
        bool per_head = stem.size() > head.size() && stem.compare(0, head.size(), head) == 0;
        for (size_t i = head.size(); per_head && i < stem.size(); ++i) per_head = stem[i] >= '0' && stem[i] <= '9';
        any = any || stem == prefix || per_head;
    }
    if (!any) return "";
    std::sort(held.begin(), held.end());
    return c.dir + "/" + held.front();
}

// Mask and bias files and dropout in a packed case: an error naming where the case asks for them
// (the manifest's key, or the file).
void refuse_unsupported(const InputCase& c, const Manifest* m) {
    if (m) {
        const bool mask = c.variant.mask != Coverage::none, bias = c.variant.bias != Coverage::none;
        const std::string problem = unsupported_with_packing(mask, bias, c.variant.dropout > 0.f);
        if (problem.empty()) return;
        const char* key = mask ? kMaskInput : bias ? kBiasInput : "dropout";
        const std::string value = mask   ? std::string("\"") + coverage_name(c.variant.mask) + "\""
                                  : bias ? std::string("\"") + coverage_name(c.variant.bias) + "\""
                                         : toml_float(m->find("dropout")->f);
        fail(kExitBadInput, m->where(key) + ": " + key + " = " + value + ": " + problem, kPackedVariantsHint);
    }
    const std::string mask = first_tensor_file(c, kMaskInput);
    const std::string bias = mask.empty() ? first_tensor_file(c, kBiasInput) : "";
    if (mask.empty() && bias.empty()) return;
    fail(kExitBadInput, (mask.empty() ? bias : mask) + ": " + unsupported_with_packing(!mask.empty(), !bias.empty(), false),
         kPackedVariantsHint);
}

// In a packed case seq_q and seq_k are the packed tokens: the offsets' last values.
void check_total(const InputCase& c, const Manifest* m, const char* name, long long total, const char* key, int dim,
                 Stage stage, const char* what) {
    if (total == dim) return;
    const std::string said = m ? m->path + " says " + key + " = " + std::to_string(dim)
                               : fs::path(c.file(stage, 0)).filename().string() + " has " + plural(dim, "row");
    fail(kExitBadInput, file_path(c, name, c.format) + ": ends at " + std::to_string(total) + " (the packed " + what +
                            "), but " + said,
         std::string(key) + " is the total of the sequences' lengths");
}

// cu_seqlens_q, its count of offsets the manifest's B + 1.
std::vector<long long> read_offsets(const InputCase& c, const Manifest* m) {
    const ManifestValue* key = m ? m->find(kSequencesKey) : nullptr;
    std::vector<long long> cu_q = read_integer_column(file_path(c, kCuSeqlensQ, c.format), c.format).values;
    if (key && static_cast<long long>(cu_q.size()) != key->i + 1)
        fail(kExitBadInput, file_path(c, kCuSeqlensQ, c.format) + ": " +
                                plural(static_cast<long long>(cu_q.size()), "offset") + ", but " + m->path + " says " +
                                kSequencesKey + " = " + std::to_string(key->i) + ", which takes " +
                                std::to_string(key->i + 1) + " (B + 1)");
    return cu_q;
}

// A paged case (docs/contract.md, "Paged KV caches"): cu_seqlens_q, seqused_k and block_table, no
// cu_seqlens_k; forward only; K and V hold whole pages. In the Python reader's order and words
// (verify/files/sequence_files.py _paged_sequences).
void check_paged_files(InputCase* c, const Manifest* m, bool has_cu_k, bool has_q, bool has_used, bool has_table) {
    const std::string fmt = format_name(c->format);
    if (has_cu_k) {
        const Format shown = exists(file_path(*c, kCuSeqlensK, Format::npy)) ? Format::npy : Format::txt;
        fail(kExitBadInput, file_path(*c, kCuSeqlensK, shown) + ": " + paged_cu_seqlens_k_problem(fmt),
             kPagedCuSeqlensKHint);
    }
    if (!m)
        fail(kExitBadInput, file_path(*c, kBlockTable, c->format) + ": " + paged_page_size_unknown(),
             kPageSizeUnknownHint);
    const ManifestValue* key = m->find(kSequencesKey);
    const long long page_size = m->find(kPageSizeKey)->i;
    const std::string says = std::string(kInputManifestName) + " says ";
    if (!has_q)
        fail(kExitBadInput, file_path(*c, kCuSeqlensQ, c->format) + ": missing file (" + says + kSequencesKey + " = " +
                                std::to_string(key->i) + ")");
    if (!has_table)
        fail(kExitBadInput, file_path(*c, kBlockTable, c->format) + ": missing file (" + says + kPageSizeKey + " = " +
                                std::to_string(page_size) + ")");
    if (!has_used)
        fail(kExitBadInput, file_path(*c, kSequsedK, c->format) + ": missing file (" + kPagedNeedsSeqused + ")");
    if (c->backward) {
        const std::string where =
            m->find("backward") ? m->where("backward") + ": backward = true" : c->file(Stage::dO, 0);
        fail(kExitBadInput, where + ": " + kPagedBackward, kPagedBackwardHint);
    }
    const std::vector<long long> cu_q = read_offsets(*c, m);
    const std::vector<long long> used = read_integer_column(file_path(*c, kSequsedK, c->format), c->format).values;
    const IntegerColumn table = read_integer_matrix(file_path(*c, kBlockTable, c->format), c->format, kTableEntryRange);
    if (c->dims.M % page_size != 0)
        fail(kExitBadInput,
             m->where("seq_k") + ": seq_k = " + std::to_string(c->dims.M) + pool_rows_problem(page_size));
    const std::string problem =
        paged_problem(cu_q, used, table.values, table.rows, table.cols, page_size, c->dims.M / page_size);
    if (!problem.empty()) fail(kExitBadInput, problem_file(*c, problem) + ": " + problem);
    check_total(*c, m, kCuSeqlensQ, cu_q.back(), "seq_q", c->dims.N, Stage::Q, "queries");
    Sequences& s = c->sequences;
    s.cu_q = cu_q;
    s.used_k = used;
    s.page_size = static_cast<int>(page_size);
    s.pages_per_seq = table.cols;
    s.pool_rows = c->dims.M;
    s.block_table = table.values;
}

}  // namespace

void check_packed_manifest(const InputCase& c, const Manifest& m) {
    const ManifestValue* key = m.find(kSequencesKey);
    const ManifestValue* page = m.find(kPageSizeKey);
    if (page && !key) fail(kExitBadInput, m.where(kPageSizeKey) + ": " + paged_unpacked_problem(page->i));
    if (m.find(kNewKeysKey) && !key) check_new_keys_manifest(m);
    if (!key) return;
    if (key->i < 1 || key->i > kMaxTokens) fail(kExitBadInput, m.where(kSequencesKey) + ": " + sequences_count_problem(key->i));
    if (c.dims.batch != 1)
        fail(kExitBadInput, (m.find("batch") ? m.where("batch") : m.path) + ": " + packed_batch_problem(c.dims.batch, key->i));
    if (page && (page->i < 1 || page->i > kMaxTokens))
        fail(kExitBadInput, m.where(kPageSizeKey) + ": " + page_size_problem(page->i));
    check_new_keys_manifest(m);
}

void check_sequence_files(InputCase* c, const Manifest* m) {
    const SequenceFiles files = find_files(*c);
    const ManifestValue* key = m ? m->find(kSequencesKey) : nullptr;
    const ManifestValue* page = m ? m->find(kPageSizeKey) : nullptr;
    const int kQ = 0, kK = 1, kUsed = 2, kTable = 3;
    const bool packed = m ? key != nullptr : files.any(kQ) || files.any(kK) || files.any(kTable);
    const bool paged = m ? page != nullptr : files.any(kTable);
    const int own = static_cast<int>(c->format), other = 1 - own;
    for (int i = 0; i < kNumSequenceFiles; ++i) {  // in kSequenceFiles' order, as the Python reader looks
        if (!files.any(i)) continue;
        const Format shown = files.has[i][static_cast<int>(Format::npy)] ? Format::npy : Format::txt;  // sorted first
        if (!packed) {
            const std::string why = m ? std::string("no ") + kSequencesKey + " = B in " + kInputManifestName
                                      : std::string("no ") + kCuSeqlensQ + " and " + kCuSeqlensK + " files";
            fail(kExitBadInput, file_path(*c, kSequenceFiles[i], shown) + ": " + kNotPacked + " (" + why + ")",
                 kNotPackedHint);
        }
        if (i == kTable && !paged)
            fail(kExitBadInput, file_path(*c, kBlockTable, shown) + ": " + kNotPaged + " (no " + kPageSizeKey + " = P in " +
                                    kInputManifestName + ")",
                 kNotPagedHint);
        if (files.has[i][other]) {
            const Format f = static_cast<Format>(other);
            fail(kExitBadInput, file_path(*c, kSequenceFiles[i], f) + ": a ." + format_name(f) + " file in a ." +
                                    format_name(c->format) + " case",
                 "a case holds one format; remove the stray file");
        }
    }
    if (!packed) return check_new_key_files(c, m);
    refuse_unsupported(*c, m);
    if (paged) {
        check_paged_files(c, m, files.any(kK), files.has[kQ][own], files.has[kUsed][own], files.has[kTable][own]);
        return check_new_key_files(c, m);
    }
    for (int i = 0; i < 2; ++i)
        if (!files.has[i][own])
            fail(kExitBadInput, file_path(*c, kSequenceFiles[i], c->format) + ": missing file (" +
                                    (key ? std::string(kInputManifestName) + " says " + kSequencesKey + " = " +
                                               std::to_string(key->i)
                                         : std::string("a packed case has both cu_seqlens files")) +
                                    ")");
    std::vector<long long> column[3];
    column[0] = read_offsets(*c, m);
    column[1] = read_integer_column(file_path(*c, kCuSeqlensK, c->format), c->format).values;
    const bool used = files.has[2][own];
    if (used) column[2] = read_integer_column(file_path(*c, kSequsedK, c->format), c->format).values;
    const std::string problem = sequences_problem(column[0], column[1], used ? &column[2] : nullptr);
    if (!problem.empty()) fail(kExitBadInput, problem_file(*c, problem) + ": " + problem);
    check_total(*c, m, kCuSeqlensQ, column[0].back(), "seq_q", c->dims.N, Stage::Q, "queries");
    check_total(*c, m, kCuSeqlensK, column[1].back(), "seq_k", c->dims.M, Stage::K, "keys");
    c->sequences.cu_q = column[0];
    c->sequences.cu_k = column[1];
    c->sequences.used_k = column[2];
    check_new_key_files(c, m);
}

void check_packed_dropout_option(const InputCase& c, double dropout) {
    if (!c.packed() || !(dropout > 0)) return;
    fail(kExitBadInput, "--dropout " + toml_float(dropout) + ": " + unsupported_with_packing(false, false, true),
         kPackedVariantsHint);
}

}  // namespace attnstep
