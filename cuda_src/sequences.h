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

#include <string>
#include <vector>

namespace attnstep {

// The input case's files that describe the sequences (txt or npy, as every input), and the manifest
// key whose presence makes a case packed (its value: the number of sequences B).
inline constexpr const char kCuSeqlensQ[] = "cu_seqlens_q";
inline constexpr const char kCuSeqlensK[] = "cu_seqlens_k";
inline constexpr const char kSequsedK[] = "seqused_k";
inline constexpr const char* kSequenceFiles[] = {kCuSeqlensQ, kCuSeqlensK, kSequsedK};
inline constexpr const char kSequencesKey[] = "sequences";

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

}  // namespace attnstep
