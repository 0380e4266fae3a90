// sequences.h — packed sequences (flash-attn's varlen convention) in C++: B sequences of different
// lengths packed along the token axis of every per-head matrix, described by cu_seqlens_q and
// cu_seqlens_k (B + 1 offsets each) and optionally seqused_k (the keys each sequence uses, for a
// KV cache padded to a fixed slot per sequence). verify/sequences.py is the Python twin (its module
// doc states the conventions); docs/contract.md ("Packed sequences", "Paged KV caches") describes both.
//
// A paged case (the manifest's page_size = P, the file block_table) keeps its keys in a pool of
// pages of P keys: K and V hold num_pages * P rows, and key j of sequence b is pool row
// block_table[b][j / P] * P + j % P (key_row). It has seqused_k (the keys each sequence reads) and no
// cu_seqlens_k; entries of pages a sequence does not read are ignored.
//
// Sequence b owns query rows [cu_q[b], cu_q[b+1]) and the key slot [cu_k[b], cu_k[b+1]); it reads the
// first m(b) keys of its slot. Attention is block-diagonal: the binary computes a packed case as one
// dense problem per sequence (n(b) queries, m(b) keys), so every variant applies within a sequence,
// or, where a backend has a kernel that reads the sequences' rows itself, in one call (packed_run.h).
#pragma once

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "stages.h"

namespace attnstep {

// The input case's files that describe the sequences (txt or npy, as every input), and the manifest
// key whose presence makes a case packed (its value: the number of sequences B).
inline constexpr const char kCuSeqlensQ[] = "cu_seqlens_q";
inline constexpr const char kCuSeqlensK[] = "cu_seqlens_k";
inline constexpr const char kSequsedK[] = "seqused_k";
inline constexpr const char kBlockTable[] = "block_table";
// In the order both readers look at them.
inline constexpr const char* kSequenceFiles[] = {kCuSeqlensQ, kCuSeqlensK, kSequsedK, kBlockTable};
inline constexpr int kNumSequenceFiles = 4;
inline constexpr const char kSequencesKey[] = "sequences";
// The manifest key whose presence makes a packed case paged (its value: the keys a page holds).
inline constexpr const char kPageSizeKey[] = "page_size";
// A decode step's new keys: the manifest key (their count n per sequence) and the input files that
// hold them per K/V head, by the cache they are appended to ("K_new_head_<j>": sequence b's new keys
// at rows b*n .. b*n + n - 1). Sequence b's new key t lands at its key seqused_k[b] + t.
inline constexpr const char kNewKeysKey[] = "new_keys";
inline constexpr const char kNewKeysInput[] = "K_new";
inline constexpr const char kNewValuesInput[] = "V_new";

// Every value of those files is a count of tokens: a whole number in 0..kMaxTokens (a dimension's
// largest, so the offsets and their totals fit seq_q and seq_k), and the number of sequences B is
// 1..kMaxTokens too.
inline constexpr long long kMaxTokens = kMaxDim;

// The values a file of whole numbers may hold, and what such a value is (in the words after
// "is outside lo..hi"): the offsets and seqused_k are counts of tokens; a block_table entry is any
// int32 (flash-attn's dtype: entries of pages no sequence reads may be anything, -1 as padding).
struct WholeRange {
    long long lo, hi;
    const char* what;
};
inline constexpr WholeRange kCountRange{0, kMaxTokens, "a count of tokens"};
inline constexpr WholeRange kTableEntryRange{-2147483648LL, 2147483647LL, "a block_table entry, an int32"};
// How much of a token that is not an integer an error quotes.
inline constexpr int kQuotedTokenLimit = 40;
// A sequence file in a case that is not packed would be ignored: the words after the file's path
// (as a slopes file without ALiBi), and the hint.
inline constexpr const char kNotPacked[] = "exists but the case is not packed";
inline constexpr const char kNotPackedHint[] =
    "add sequences = B (the number of sequences) to the manifest, or remove the file";
// A block_table in a packed case without page_size: the words after the file's path, and the hint.
inline constexpr const char kNotPaged[] = "exists but the case is not paged";
inline constexpr const char kNotPagedHint[] = "add page_size = P (the keys a page holds) to the manifest, or remove the file";

// The packing of one case; empty (count() == 0) for a case that is not packed. Offsets are checked
// by sequences_problem before a Sequences is used, and then fit an int (the totals are seq_q and
// seq_k, at most kMaxDim).
struct Sequences {
    std::vector<long long> cu_q, cu_k;  // cu_k empty in a paged case
    std::vector<long long> used_k;  // empty: every sequence reads its whole slot (required when paged)
    // A paged case: the keys a page holds (0: not paged), and the table, count() rows of
    // pages_per_seq entries, row-major; pool_rows the rows of K and V (num_pages * page_size).
    int page_size = 0, pages_per_seq = 0, pool_rows = 0;
    std::vector<long long> block_table;
    // A decode step: the new keys appended to each sequence before attention (used_k counts them;
    // the files hold the cache before the step).
    int new_keys = 0;

    bool packed() const { return !cu_q.empty(); }
    int count() const { return cu_q.empty() ? 0 : static_cast<int>(cu_q.size()) - 1; }
    int total_q() const { return static_cast<int>(cu_q.back()); }
    bool paged() const { return page_size > 0; }
    // The rows of K and V: the packed key rows, or the pool's.
    int total_k() const { return paged() ? pool_rows : static_cast<int>(cu_k.back()); }
    // Queries of sequence b, and their first packed row.
    int n(int b) const { return static_cast<int>(cu_q[b + 1] - cu_q[b]); }
    int q_begin(int b) const { return static_cast<int>(cu_q[b]); }
    // Keys sequence b reads (the first m(b) of its slot, or of its pages).
    int m(int b) const { return used_k.empty() ? slot(b) : static_cast<int>(used_k[b]); }
    // The row of K and V that holds key j of sequence b (j < m(b)): through the table when paged,
    // else the slot's j-th row. Every reader of a sequence's keys goes through it.
    int key_row(int b, int j) const {
        if (!paged()) return k_begin(b) + j;
        const long long page = block_table[static_cast<size_t>(b) * pages_per_seq + j / page_size];
        return static_cast<int>(page * page_size + j % page_size);
    }
    // The keys sequence b's cache holds before the step (seqused_k as the files say).
    int cache_len(int b) const { return m(b) - new_keys; }
    // Sequence b's key slot (not paged): its first packed row and its length, padding included.
    int k_begin(int b) const { return static_cast<int>(cu_k[b]); }
    int slot(int b) const { return static_cast<int>(cu_k[b + 1] - cu_k[b]); }
    // Whether sequence b is a dense problem of its own: it has queries and keys. A sequence without
    // keys gives its rows output 0 and lse -inf; one without queries contributes nothing.
    bool computed(int b) const { return n(b) >= 1 && m(b) >= 1; }
};

// What is wrong with the packing, or "" (the words after "<file>: "; they start with the name of the
// file they are about). verify/sequences.py sequences_problem is the twin, in the same words.
inline std::string sequences_problem(const std::vector<long long>& cu_q, const std::vector<long long>& cu_k,
                                     const std::vector<long long>* used_k) {
    const std::string q = kCuSeqlensQ, k = kCuSeqlensK, used = kSequsedK;
    auto str = [](long long v) { return std::to_string(v); };
    if (cu_q.size() < 2) return q + " needs at least 2 offsets (one sequence), got " + str(cu_q.size());
    if (cu_k.size() != cu_q.size())
        return k + " has " + str(cu_k.size()) + " offsets, " + q + " " + str(cu_q.size()) +
               ": both need B + 1 for B sequences";
    const std::vector<long long>* offsets[] = {&cu_q, &cu_k};
    for (int f = 0; f < 2; ++f) {
        const std::vector<long long>& cu = *offsets[f];
        const std::string& name = f == 0 ? q : k;
        if (cu[0] != 0) return name + " must start at 0, got " + str(cu[0]);
        for (size_t b = 0; b + 1 < cu.size(); ++b)
            if (cu[b + 1] < cu[b])
                return name + " must not decrease: offset " + str(b + 1) + " is " + str(cu[b + 1]) + " after " + str(cu[b]);
    }
    if (used_k) {
        if (used_k->size() != cu_q.size() - 1)
            return used + " has " + str(used_k->size()) + " values for " + str(cu_q.size() - 1) + " sequences";
        for (size_t b = 0; b < used_k->size(); ++b) {
            const long long u = (*used_k)[b], slot = cu_k[b + 1] - cu_k[b];
            if (u < 0 || u > slot)
                return used + "[" + str(b) + "] = " + str(u) + " is outside 0.." + str(slot) + " (sequence " + str(b) +
                       "'s key slot)";
        }
    }
    return "";
}

// ------------------------------------------------------------------------------------------------
// The rules of one value of a sequence file, in the words both readers say after
// "<file>:<line>:<col>: " (a text file) or "<file>:row <r>, col 0: " (an .npy file).

// A token from a file as messages show it (verify/text.py printable, for the ASCII a text sequence
// file holds): control characters escaped, cut to `limit` characters with "..." (whole pieces only).
inline std::string printable_token(const std::string& token, int limit = kQuotedTokenLimit) {
    std::vector<std::string> pieces;
    size_t length = 0;
    for (unsigned char ch : token) {
        std::string piece(1, static_cast<char>(ch));
        if (ch < 0x20 || (ch >= 0x7f && ch < 0xa0)) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\x%02x", ch);
            piece = buf;
        }
        if (length + piece.size() > static_cast<size_t>(limit)) {
            const size_t cut = static_cast<size_t>(limit) - 3;
            while (!pieces.empty() && length > cut) {
                length -= pieces.back().size();
                pieces.pop_back();
            }
            std::string out;
            for (const std::string& p : pieces) out += p;
            return out + "...";
        }
        length += piece.size();
        pieces.push_back(piece);
    }
    std::string out;
    for (const std::string& p : pieces) out += p;
    return out;
}

// A value out of the range, shown as the file writes it.
inline std::string count_range_problem(const std::string& shown, const WholeRange& range = kCountRange) {
    return shown + " is outside " + std::to_string(range.lo) + ".." + std::to_string(range.hi) + " (" + range.what +
           ")";
}

// What is wrong with one token of a text file of whole numbers: an optional sign and decimal digits,
// whose value is in the range; "" when it is one (then *value holds it).
inline std::string integer_token_problem(const std::string& token, long long* value,
                                         const WholeRange& range = kCountRange) {
    const size_t first = !token.empty() && (token[0] == '+' || token[0] == '-') ? 1 : 0;
    bool digits = first < token.size();
    for (size_t i = first; i < token.size(); ++i) digits = digits && token[i] >= '0' && token[i] <= '9';
    if (!digits) return "not an integer: '" + printable_token(token) + "'";
    // Leading zeros aside, more digits than any range's bound has is out of range (and would overflow).
    size_t lead = first;
    while (lead + 1 < token.size() && token[lead] == '0') ++lead;
    const std::string magnitude = token.substr(lead);
    long long v = 0;
    if (magnitude.size() <= 12) v = std::stoll(magnitude);
    if (token[0] == '-') v = -v;
    if (magnitude.size() > 12 || v < range.lo || v > range.hi) return count_range_problem(printable_token(token), range);
    *value = v;
    return "";
}

// What is wrong with one value of an .npy file of whole numbers: one in the range, or "".
inline std::string count_problem(long long value, const WholeRange& range = kCountRange) {
    return value < range.lo || value > range.hi ? count_range_problem(std::to_string(value), range) : "";
}
inline std::string count_problem_unsigned(unsigned long long value, const WholeRange& range = kCountRange) {
    return value > static_cast<unsigned long long>(range.hi) ? count_range_problem(std::to_string(value), range) : "";
}
// A float32 value: "not an integer" as %.9g shows it, else the range as its integer shows it.
inline std::string count_problem_float(float f, long long* value, const WholeRange& range = kCountRange) {
    char buf[64];
    if (std::isnan(f)) return "not an integer: nan";
    if (!std::isfinite(f) || f != std::nearbyint(f)) {
        std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(f));
        return std::string("not an integer: ") + buf;
    }
    if (static_cast<double>(f) < static_cast<double>(range.lo) || static_cast<double>(f) > static_cast<double>(range.hi)) {
        std::snprintf(buf, sizeof buf, "%.0f", static_cast<double>(f));
        return count_range_problem(f == 0 ? "0" : buf, range);
    }
    *value = static_cast<long long>(f);
    return "";
}

// ------------------------------------------------------------------------------------------------
// Paged KV caches (verify/sequences.py has the twins, in the same words).

// The manifest's page_size out of range (the words after the manifest's place).
inline std::string page_size_problem(long long page_size) {
    return std::string(kPageSizeKey) + " = " + std::to_string(page_size) + ": the keys a page holds must be in 1.." +
           std::to_string(kMaxTokens);
}

// page_size in a manifest without sequences (the words after the manifest's place).
inline std::string paged_unpacked_problem(long long page_size) {
    return std::string(kPageSizeKey) + " = " + std::to_string(page_size) + " without " + kSequencesKey +
           " = B: a paged case is a packed case";
}

// seq_k (the pool's rows) not whole pages: the words after "<where> says seq_k = M" or "<K file> has M rows".
inline std::string pool_rows_problem(long long page_size) {
    return ", not a multiple of " + std::string(kPageSizeKey) + " = " + std::to_string(page_size) +
           " (K and V hold the pool of pages)";
}

// What a paged case asks for that paging does not support: the backward pass.
inline constexpr const char kPagedBackward[] = "the backward pass is not supported with paged KV caches";
inline constexpr const char kPagedBackwardHint[] = "a paged case is forward only; check the backward pass on a packed case";
// A paged case has no cu_seqlens_k (the words after its path) and needs seqused_k.
inline std::string paged_cu_seqlens_k_problem(const std::string& fmt) {
    return std::string("a paged case (") + kBlockTable + "." + fmt + ") reads its keys through " + kBlockTable +
           ", not " + kCuSeqlensK;
}
inline constexpr const char kPagedCuSeqlensKHint[] = "remove cu_seqlens_k, or block_table for a case without pages";
inline constexpr const char kPagedNeedsSeqused[] = "a paged case has seqused_k: the keys each sequence reads";
// Without a manifest a block_table gives no page size (the words after its path).
inline std::string paged_page_size_unknown() {
    return std::string("a paged case needs its page size, and there is no manifest to say ") + kPageSizeKey + " = P";
}
inline constexpr const char kPageSizeUnknownHint[] =
    "write a manifest.toml with sequences = B and page_size = P (attnstep check also takes --page-size P)";

// What is wrong with a paged case's sequences (the words after "<file>: "; they start with the name
// of the file they are about), or "": cu_seqlens_q's offsets, seqused_k's count, block_table's rows
// (one per sequence), enough pages for each sequence's keys, and every page a sequence reads in the
// pool. table: rows x cols entries row-major.
inline std::string paged_problem(const std::vector<long long>& cu_q, const std::vector<long long>& used_k,
                                 const std::vector<long long>& table, long long rows, long long cols,
                                 long long page_size, long long num_pages) {
    const std::string q = kCuSeqlensQ, used = kSequsedK, bt = kBlockTable;
    auto str = [](long long v) { return std::to_string(v); };
    if (cu_q.size() < 2) return q + " needs at least 2 offsets (one sequence), got " + str(cu_q.size());
    if (cu_q[0] != 0) return q + " must start at 0, got " + str(cu_q[0]);
    for (size_t b = 0; b + 1 < cu_q.size(); ++b)
        if (cu_q[b + 1] < cu_q[b])
            return q + " must not decrease: offset " + str(b + 1) + " is " + str(cu_q[b + 1]) + " after " + str(cu_q[b]);
    const long long count = static_cast<long long>(cu_q.size()) - 1;
    if (static_cast<long long>(used_k.size()) != count)
        return used + " has " + str(used_k.size()) + " values for " + str(count) + " sequences";
    if (rows != count) return bt + " has " + str(rows) + " rows for " + str(count) + " sequences";
    for (long long b = 0; b < count; ++b)
        if (used_k[b] > cols * page_size)
            return used + "[" + str(b) + "] = " + str(used_k[b]) + " is more than the " + str(cols) + " pages of " +
                   str(page_size) + " keys a " + bt + " row holds (" + str(cols * page_size) + ")";
    for (long long b = 0; b < count; ++b)
        for (long long j = 0; j * page_size < used_k[b]; ++j) {
            const long long e = table[b * cols + j];
            if (e < 0 || e >= num_pages)
                return bt + "[" + str(b) + ", " + str(j) + "] = " + str(e) + " is outside 0.." + str(num_pages - 1) +
                       " (the pool holds " + str(num_pages) + " pages of " + str(page_size) + " keys); sequence " +
                       str(b) + " reads it";
        }
    return "";
}

// What a packed case asks for that packing does not support (mask or bias files, dropout), in both
// readers' words; "" when nothing.
inline std::string unsupported_with_packing(bool mask, bool bias, bool dropout) {
    const char* words = mask ? "mask files are" : bias ? "bias files are" : dropout ? "dropout is" : nullptr;
    return words ? std::string(words) + " not supported with packed sequences" : "";
}

// The hint of those refusals.
inline constexpr const char kPackedVariantsHint[] =
    "packed sequences take causal, windows, softcap, ALiBi and grouped K/V heads; run a sequence that needs a mask, "
    "a bias or dropout as a case of its own";

// The manifest's `sequences` out of range; a batch other than 1 with it (words after the manifest's
// place).
inline std::string sequences_count_problem(long long count) {
    return std::string(kSequencesKey) + " = " + std::to_string(count) + ": the number of sequences must be in 1.." +
           std::to_string(kMaxTokens);
}
inline std::string packed_batch_problem(long long batch, long long count) {
    return "batch = " + std::to_string(batch) + " with " + kSequencesKey + " = " + std::to_string(count) +
           ": a packed case has batch = 1 (its sequences are the batch)";
}

// ------------------------------------------------------------------------------------------------
// A decode step's new keys (verify/sequences.py and verify/files/new_keys.py have the twins, in the
// same words).

inline constexpr const char kNewKeysBackward[] = "the backward pass is not supported with new keys (a decode step)";
inline constexpr const char kNewKeysBackwardHint[] =
    "a decode step is forward only; check the backward pass on a case without new_keys";
inline constexpr const char kNewKeysNeedSequsedK[] =
    "a case with new keys has seqused_k: the keys each sequence's cache holds before the step";
inline constexpr const char kNotAppended[] = "exists but the case has no new keys";
inline constexpr const char kNotAppendedHint[] =
    "add new_keys = n (the keys appended to each sequence) with sequences = B to the manifest, or remove the file";
inline constexpr const char kNewKeysNoManifest[] = "a case with new keys needs a manifest to say new_keys = n";
inline constexpr const char kNewKeysNoManifestHint[] = "write a manifest.toml with sequences = B and new_keys = n";

// The manifest's new_keys out of range; new_keys without sequences (words after the manifest's place).
inline std::string new_keys_count_problem(long long count) {
    return std::string(kNewKeysKey) + " = " + std::to_string(count) + ": the new keys per sequence must be in 1.." +
           std::to_string(kMaxTokens);
}
inline std::string new_keys_unpacked_problem(long long count) {
    return std::string(kNewKeysKey) + " = " + std::to_string(count) + " without " + kSequencesKey +
           " = B: new keys are appended to a packed case's KV cache";
}

// What is wrong with appending `count` new keys to each sequence of s (the cache before the step:
// m(b) is seqused_k), in words that start with the file's name; "" when nothing: room in the slot
// or the table row, every page the new keys reach in the pool, no pool slot written by two sequences.
inline std::string new_keys_problem(const Sequences& s, long long count) {
    auto str = [](long long v) { return std::to_string(v); };
    const std::string used = kSequsedK, bt = kBlockTable;
    for (int b = 0; b < s.count(); ++b) {
        const long long u = s.m(b);
        const long long room = s.paged() ? static_cast<long long>(s.pages_per_seq) * s.page_size : s.slot(b);
        const std::string words = s.paged() ? "the " + str(s.pages_per_seq) + " pages of " + str(s.page_size) +
                                                  " keys a " + bt + " row holds"
                                            : "sequence " + str(b) + "'s key slot";
        if (u + count > room)
            return used + "[" + str(b) + "] = " + str(u) + " with " + str(count) + " new keys is " + str(u + count) +
                   " keys, more than " + words + " (" + str(room) + ")";
    }
    if (!s.paged()) return "";
    std::vector<long long> after(s.used_k);
    for (long long& a : after) a += count;
    const std::string problem = paged_problem(s.cu_q, after, s.block_table, s.count(), s.pages_per_seq, s.page_size,
                                              s.pool_rows / s.page_size);
    if (!problem.empty()) return problem;
    std::vector<int> writer(static_cast<size_t>(s.pool_rows), -1);
    for (int b = 0; b < s.count(); ++b)
        for (long long j = s.m(b); j < after[b]; ++j) {
            const long long row = s.block_table[static_cast<size_t>(b) * s.pages_per_seq + j / s.page_size] * s.page_size +
                                  j % s.page_size;
            int& w = writer[static_cast<size_t>(row)];
            if (w >= 0 && w != b)
                return bt + " rows " + str(w) + " and " + str(b) + " both write a new key to page " +
                       str(row / s.page_size) + ", slot " + str(row % s.page_size) +
                       ": their new keys would overwrite each other";
            w = b;
        }
    return "";
}

}  // namespace attnstep
