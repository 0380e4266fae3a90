// sequence_inputs.cpp — the files of a packed case; see sequence_inputs.h.
#include "sequence_inputs.h"

#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "../common.h"
#include "../stages.h"
#include "input_manifest.h"
#include "manifest.h"
#include "matrix_io.h"
#include "variant_manifest.h"

namespace fs = std::filesystem;

namespace attnstep {

namespace {

const Format kFormats[] = {Format::txt, Format::npy};

// What the variants a packed case cannot have: the hint of their refusals.
const char* kPackedVariantsHint =
    "packed sequences take causal, windows, softcap, ALiBi and grouped K/V heads; run a sequence that needs "
    "a mask, a bias or dropout as a case of its own";

std::string file_path(const InputCase& c, const char* name, Format fmt) {
    return c.dir + "/" + name + "." + format_name(fmt);
}

bool exists(const std::string& path) {
    std::error_code ec;
    return fs::exists(path, ec);
}

// What each file holds, for messages: "B + 1 query offsets".
const char* column_words(const char* name) {
    const std::string n = name;
    return n == kCuSeqlensQ ? "B + 1 query offsets" : n == kCuSeqlensK ? "B + 1 key offsets" : "B keys used";
}

// Which of the sequence files the case holds, in its format; a file of the other format is an
// error, as every input's is.
struct SequenceFiles {
    bool has[3] = {false, false, false};
};

SequenceFiles find_files(const InputCase& c) {
    SequenceFiles f;
    for (int i = 0; i < 3; ++i)
        for (Format fmt : kFormats) {
            const std::string path = file_path(c, kSequenceFiles[i], fmt);
            if (!exists(path)) continue;
            if (fmt != c.format)
                fail(kExitBadInput, path + ": a ." + format_name(fmt) + " file in a ." + format_name(c.format) + " case",
                     "a case holds one format; remove the stray file");
            f.has[i] = true;
        }
    return f;
}

// The file that the words of sequences_problem are about: the one whose name starts them.
std::string problem_file(const InputCase& c, const std::string& words) {
    for (const char* name : {kSequsedK, kCuSeqlensQ, kCuSeqlensK})
        if (words.compare(0, std::string(name).size(), name) == 0) return file_path(c, name, c.format);
    return c.dir;
}

// In a packed case seq_q and seq_k are the packed totals (cu_seqlens_q[B], cu_seqlens_k[B]).
void check_total(const InputCase& c, const char* name, long long total, const char* key, int dim, const char* what) {
    if (total == dim) return;
    fail(kExitBadInput, file_path(c, name, c.format) + ": " + name + " ends at " + std::to_string(total) + " but " + key +
                            " = " + std::to_string(dim) + ": in a packed case " + key + " is the total of the packed " +
                            what,
         "seq_q = cu_seqlens_q[B] and seq_k = cu_seqlens_k[B] (the packed tokens, every key slot whole)");
}

}  // namespace

void check_packed_manifest(const InputCase& c, const Manifest& m) {
    const ManifestValue* key = m.find(kSequencesKey);
    if (!key) return;
    if (key->i < 1 || key->i > kMaxDim)
        fail(kExitBadInput, m.where(kSequencesKey) + ": " + kSequencesKey + " = " + std::to_string(key->i) +
                                ": must be 1.." + std::to_string(kMaxDim) + " (the number of packed sequences)",
             "fix the value in manifest.toml");
    if (c.dims.batch != 1)
        fail(kExitBadInput, m.where("batch") + ": batch = " + std::to_string(c.dims.batch) +
                                " in a packed case: the sequences are the batch, so batch must be 1",
             "pack every sequence along the tokens: batch = 1, seq_q = cu_seqlens_q[B], seq_k = cu_seqlens_k[B]");
    if (c.variant.dropout > 0.f)
        fail(kExitBadInput, m.where("dropout") + ": dropout = " + toml_float(m.find("dropout")->f) +
                                ": dropout is not supported in a packed case",
             kPackedVariantsHint);
}

void check_sequence_files(InputCase* c, const Manifest* m) {
    const SequenceFiles files = find_files(*c);
    const ManifestValue* key = m ? m->find(kSequencesKey) : nullptr;
    const bool packed = key || (!m && (files.has[0] || files.has[1]));
    if (!packed) {
        for (int i = 0; i < 3; ++i)
            if (files.has[i])
                fail(kExitBadInput, file_path(*c, kSequenceFiles[i], c->format) + ": exists but the case is not packed",
                     m ? std::string("add sequences = B (the number of sequences) to ") + kInputManifestName +
                             ", or remove the file"
                       : "a packed case holds cu_seqlens_q and cu_seqlens_k; or remove the file");
        return;
    }
    const std::string why = key ? "the manifest says " + std::string(kSequencesKey) + " = " + std::to_string(key->i)
                                : "a packed case holds cu_seqlens_q and cu_seqlens_k";
    std::vector<long long> column[3];
    for (int i = 0; i < 3; ++i) {
        const std::string path = file_path(*c, kSequenceFiles[i], c->format);
        if (!files.has[i]) {
            if (i == 2) continue;  // optional: every sequence reads its whole slot
            fail(kExitBadInput, path + ": missing (" + why + ")",
                 std::string("write ") + kCuSeqlensQ + " and " + kCuSeqlensK + " (B + 1 offsets each, one per line)");
        }
        column[i] = read_integer_column(path, c->format, column_words(kSequenceFiles[i])).values;
    }
    if (key && static_cast<long long>(column[0].size()) != key->i + 1)
        fail(kExitBadInput, file_path(*c, kCuSeqlensQ, c->format) + ": holds " + plural(column[0].size(), "offset") +
                                " but " + why + " (B + 1 = " + std::to_string(key->i + 1) + " offsets)",
             std::string("write B + 1 offsets, or fix ") + kSequencesKey + " in manifest.toml");
    const std::string problem = sequences_problem(column[0], column[1], files.has[2] ? &column[2] : nullptr);
    if (!problem.empty())
        fail(kExitBadInput, problem_file(*c, problem) + ": " + problem,
             "cu_seqlens_q and cu_seqlens_k start at 0 and never decrease (B + 1 offsets each); seqused_k[b] is "
             "at most sequence b's key slot");
    check_total(*c, kCuSeqlensQ, column[0].back(), "seq_q", c->dims.N, "queries");
    check_total(*c, kCuSeqlensK, column[1].back(), "seq_k", c->dims.M, "keys");
    c->sequences.cu_q = column[0];
    c->sequences.cu_k = column[1];
    c->sequences.used_k = column[2];
}

void check_packed_variant(const InputCase& c, const Manifest* m) {
    if (!c.packed()) return;
    const struct {
        const char* name;
        Coverage cov;
    } inputs[] = {{kMaskInput, c.variant.mask}, {kBiasInput, c.variant.bias}};
    for (const auto& in : inputs) {
        if (in.cov == Coverage::none) continue;
        const std::string where = m && m->find(in.name) ? m->where(in.name) : c.dir;
        fail(kExitBadInput, where + ": " + in.name + " = " + coverage_name(in.cov) +
                                ": mask and bias files are not supported in a packed case",
             kPackedVariantsHint);
    }
}

void check_packed_dropout_option(const InputCase& c, double dropout) {
    if (!c.packed() || !(dropout > 0)) return;
    fail(kExitBadInput, "--dropout " + toml_float(dropout) + ": dropout is not supported in a packed case",
         kPackedVariantsHint);
}

}  // namespace attnstep
