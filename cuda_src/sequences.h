// sequences.h — packed sequences (flash-attn's varlen convention) in C++: B sequences of different
// lengths packed along the token axis of every per-head matrix, described by cu_seqlens_q and
// cu_seqlens_k (B + 1 offsets each) and optionally seqused_k (the keys each sequence uses, for a
// KV cache padded to a fixed slot per sequence). verify/sequences.py is the Python twin (its module
// doc states the conventions); docs/contract.md ("Packed sequences") describes both.
//
// Sequence b owns query rows [cu_q[b], cu_q[b+1]) and the key slot [cu_k[b], cu_k[b+1]); it reads the
// first m(b) keys of its slot. Attention is block-diagonal: the binary computes a packed case as one
// dense problem per sequence (n(b) queries, m(b) keys), so every variant applies within a sequence.
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
inline constexpr const char* kSequenceFiles[] = {kCuSeqlensQ, kCuSeqlensK, kSequsedK};
inline constexpr const char kSequencesKey[] = "sequences";

// Every value of those files is a count of tokens: a whole number in 0..kMaxTokens (a dimension's
// largest, so the offsets and their totals fit seq_q and seq_k), and the number of sequences B is
// 1..kMaxTokens too.
inline constexpr long long kMaxTokens = kMaxDim;
// How much of a token that is not an integer an error quotes.
inline constexpr int kQuotedTokenLimit = 40;
// A sequence file in a case that is not packed would be ignored: the words after the file's path
// (as a slopes file without ALiBi), and the hint.
inline constexpr const char kNotPacked[] = "exists but the case is not packed";
inline constexpr const char kNotPackedHint[] =
    "add sequences = B (the number of sequences) to the manifest, or remove the file";

// The packing of one case; empty (count() == 0) for a case that is not packed. Offsets are checked
// by sequences_problem before a Sequences is used, and then fit an int (the totals are seq_q and
// seq_k, at most kMaxDim).
struct Sequences {
    std::vector<long long> cu_q, cu_k;
    std::vector<long long> used_k;  // empty: every sequence reads its whole slot

    bool packed() const { return !cu_q.empty(); }
    int count() const { return cu_q.empty() ? 0 : static_cast<int>(cu_q.size()) - 1; }
    int total_q() const { return static_cast<int>(cu_q.back()); }
    int total_k() const { return static_cast<int>(cu_k.back()); }
    // Queries of sequence b, and their first packed row.
    int n(int b) const { return static_cast<int>(cu_q[b + 1] - cu_q[b]); }
    int q_begin(int b) const { return static_cast<int>(cu_q[b]); }
    // Keys sequence b reads (the first m(b) of its slot), and the slot's first packed row.
    int m(int b) const { return used_k.empty() ? slot(b) : static_cast<int>(used_k[b]); }
    int k_begin(int b) const { return static_cast<int>(cu_k[b]); }
    // Sequence b's whole key slot, padding included.
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

// A value out of 0..kMaxTokens, shown as the file writes it.
inline std::string count_range_problem(const std::string& shown) {
    return shown + " is outside 0.." + std::to_string(kMaxTokens) + " (a count of tokens)";
}

// What is wrong with one token of a text sequence file: an optional sign and decimal digits, whose
// value is 0..kMaxTokens; "" when it is a valid count (then *value holds it).
inline std::string integer_token_problem(const std::string& token, long long* value) {
    const size_t first = !token.empty() && (token[0] == '+' || token[0] == '-') ? 1 : 0;
    bool digits = first < token.size();
    for (size_t i = first; i < token.size(); ++i) digits = digits && token[i] >= '0' && token[i] <= '9';
    if (!digits) return "not an integer: '" + printable_token(token) + "'";
    // Leading zeros aside, more digits than kMaxTokens has is out of range (and would overflow).
    size_t lead = first;
    while (lead + 1 < token.size() && token[lead] == '0') ++lead;
    const bool negative = token[0] == '-';
    const std::string magnitude = token.substr(lead);
    long long v = 0;
    if (magnitude.size() <= 9) v = std::stoll(magnitude);
    if (magnitude.size() > 9 || (negative && v != 0) || v > kMaxTokens) return count_range_problem(printable_token(token));
    *value = v;
    return "";
}

// What is wrong with one value of an .npy sequence file: a whole number in 0..kMaxTokens, or "".
inline std::string count_problem(long long value) {
    return value < 0 || value > kMaxTokens ? count_range_problem(std::to_string(value)) : "";
}
inline std::string count_problem_unsigned(unsigned long long value) {
    return value > static_cast<unsigned long long>(kMaxTokens) ? count_range_problem(std::to_string(value)) : "";
}
// A float32 value: "not an integer" as %.9g shows it, else the range as its integer shows it.
inline std::string count_problem_float(float f, long long* value) {
    char buf[64];
    if (std::isnan(f)) return "not an integer: nan";
    if (!std::isfinite(f) || f != std::nearbyint(f)) {
        std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(f));
        return std::string("not an integer: ") + buf;
    }
    if (f < 0 || f > static_cast<float>(kMaxTokens)) {
        std::snprintf(buf, sizeof buf, "%.0f", static_cast<double>(f));
        return count_range_problem(f == 0 ? "0" : buf);
    }
    *value = static_cast<long long>(f);
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

}  // namespace attnstep
