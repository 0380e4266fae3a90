// variant.h — the attention variants a case may ask for, in C++ (grouped K/V heads are a dimension:
// Dims::kv_heads in stages.h): the causal mask's alignment, a sliding window, a softcap, ALiBi, mask and bias files, dropout. verify/variant.py is
// the Python twin (its module doc states the conventions: flash-attn's and PyTorch's); both
// backends' kernels and the CPU loops call the functions here, on the host and on the device, so
// that every path computes one definition.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define ATTNSTEP_HD __host__ __device__ __forceinline__
#else
#define ATTNSTEP_HD inline
#endif

namespace attnstep {

enum class Align { top_left, bottom_right };
inline constexpr const char* kAlignNames[] = {"top-left", "bottom-right"};
// How a mask or bias file covers the heads (manifest `mask`/`bias`): none, one matrix per query
// head, or one matrix for every head.
enum class Coverage { none, per_head, broadcast };
inline constexpr const char* kCoverageNames[] = {"none", "per-head", "broadcast"};
inline constexpr int kUnbounded = -1;

// The manifest keys of a variant (input manifest.toml and run.toml) with their types: the twin of
// verify/variant.py VARIANT_KEYS, in its order. The binary's manifest reader takes the key list
// and the types from here (io/variant_manifest.cpp); run.toml writes them in this order.
enum class KeyType { Int, Float, Bool, String };
struct VariantKey {
    const char* key;
    KeyType type;
};
inline constexpr VariantKey kVariantKeys[] = {
    {"align", KeyType::String},      {"window_left", KeyType::Int}, {"window_right", KeyType::Int},
    {"softcap", KeyType::Float},     {"alibi", KeyType::Bool},      {"bias", KeyType::String},
    {"mask", KeyType::String},       {"dropout", KeyType::Float},   {"dropout_seed", KeyType::Int},
};

// The visible keys of each query row: diag(r) − left <= c <= diag(r) + right with diag(r) = r +
// offset (offset 0 top-left, M − N bottom-right); kUnbounded drops that side. causal sets right = 0.
struct MaskRule {
    long long offset = 0;
    long long left = kUnbounded, right = kUnbounded;

    ATTNSTEP_HD bool visible(long long r, long long c) const {
        const long long diag = r + offset;
        return (left == kUnbounded || c >= diag - left) && (right == kUnbounded || c <= diag + right);
    }
    ATTNSTEP_HD bool masks_anything() const { return left != kUnbounded || right != kUnbounded; }
    // [first, end) of the keys row r may see, clipped to [0, M) (first >= end: none).
    ATTNSTEP_HD long long first_key(long long r) const {
        const long long f = left == kUnbounded ? 0 : r + offset - left;
        return f < 0 ? 0 : f;
    }
    ATTNSTEP_HD long long end_key(long long r, long long M) const {
        const long long e = right == kUnbounded ? M : r + offset + right + 1;
        return e > M ? M : e < 0 ? 0 : e;
    }
    // The keys any row of [r0, r1) may see: what a tile of query rows must visit.
    ATTNSTEP_HD long long first_key_of_rows(long long r0) const { return first_key(r0); }
    ATTNSTEP_HD long long end_key_of_rows(long long r1, long long M) const { return end_key(r1 - 1, M); }
};

struct Variant {
    bool causal = false;
    Align align = Align::top_left;
    long long window_left = kUnbounded, window_right = kUnbounded;
    float softcap = 0.f;           // 0: none; else S <- C·tanh(S/C) after the scale
    bool alibi = false;            // S <- S − slope_h·|diag(r) − c|; slopes from alibi_slope() or a file
    Coverage bias = Coverage::none;
    Coverage mask = Coverage::none;
    float dropout = 0.f;           // probability of dropping; the keep-mask is the stage dropout_mask
    uint64_t dropout_seed = 0;

    MaskRule rule(long long N, long long M) const {
        MaskRule m;
        m.offset = align == Align::bottom_right ? M - N : 0;
        m.left = window_left;
        m.right = causal ? 0 : window_right;
        return m;
    }
    bool modifies_scores() const { return softcap > 0.f || alibi || bias != Coverage::none; }
};

// C·tanh(S/C) (cap 0: S unchanged); -inf stays -inf.
ATTNSTEP_HD float apply_softcap(float s, float cap) { return cap > 0.f ? cap * tanhf(s / cap) : s; }
// The derivative of apply_softcap with respect to s: 1 − t², t = tanh(s/C) (1 without a cap). The
// backward multiplies dS by it on the way to dQ and dK (flash-attn's convention: dS itself is the
// gradient of the softmax's input).
ATTNSTEP_HD float softcap_derivative(float s, float cap) {
    if (!(cap > 0.f)) return 1.f;
    const float t = tanhf(s / cap);
    return 1.f - t * t;
}

// The standard ALiBi slope of head h of `heads` (verify/variant.py alibi_slopes): 2^(−8(h+1)/n)
// with n the largest power of two <= heads; heads beyond n take every other slope of 2n heads.
inline double alibi_slope(int h, int heads) {
    int n = 1;
    while (n * 2 <= heads) n *= 2;
    if (h < n) return std::pow(2.0, -8.0 * (h + 1) / n);
    return std::pow(2.0, -8.0 * (2 * (h - n) + 1) / (2 * n));
}

// −slope·|diag(r) − c|: ALiBi's bias of score (r, c), flash-attn's sign.
ATTNSTEP_HD float alibi_bias(float slope, long long r, long long c, const MaskRule& m) {
    const long long dist = r + m.offset - c;
    return -slope * static_cast<float>(dist < 0 ? -dist : dist);
}

// Dropout's keep decision for score (r, c) of flat query head `head`: a counter-based hash
// (SplitMix64's finaliser) of (seed, head, r, c), so the CPU and the GPU keep the same entries
// without sharing a generator state. Kept with probability 1 − p.
ATTNSTEP_HD uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
ATTNSTEP_HD bool dropout_keep(uint64_t seed, long long head, long long r, long long c, long long M, float p) {
    const uint64_t h = mix64(mix64(mix64(seed) ^ static_cast<uint64_t>(head)) ^ static_cast<uint64_t>(r * M + c));
    const float u = static_cast<float>(h >> 40) * (1.f / 16777216.f);  // 24 random bits in [0, 1)
    return u >= p;
}

}  // namespace attnstep
