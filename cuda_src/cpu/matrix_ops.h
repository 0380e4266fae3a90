// matrix_ops.h — the float32 loops the CPU backend's stages are made of. Every sum runs in index
// order, one float32 rounding per operation (no FMA on x86-64 without -march flags): the order
// the verifier's cpu model assumes (backend_cpu.cpp's header says the rest).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include "../backend.h"

namespace attnstep {
namespace cpu {

const float kNegInf = -std::numeric_limits<float>::infinity();

// A GEMM's weight operand as the kernel's tensor cores would read it: TF32 or the half format.
inline float gemm_operand(Precision p, float x) { return p == Precision::tf32 ? round_tf32(x) : round_to(p, x); }

// std::max(m, x), except that a NaN in either stays NaN: a row maximum over scores that hold a NaN
// (NaN in Q or K under --allow-nonfinite) is NaN, so the whole row's softmax, output and lse are
// NaN, as the reference's are. std::max(-inf, NaN) would drop it, and a row of NaN scores would
// look like a row with no visible key.
inline float max_keep_nan(float m, float x) { return m < x || x != x ? x : m; }

// A rows x cols matrix transposed (cols x rows).
inline std::vector<float> transposed(const float* a, int rows, int cols) {
    std::vector<float> t(static_cast<size_t>(rows) * cols);
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) t[static_cast<size_t>(c) * rows + r] = a[static_cast<size_t>(r) * cols + c];
    return t;
}

// out[0..n) = x[0..k) . B (k x n, row-major), accumulated over k in order; with tf32, each x[t]
// is rounded as a tensor core reads it (B is rounded by the caller, once).
inline void row_times_matrix(const float* x, const float* B, int k, int n, float* out, bool tf32 = false) {
    std::fill_n(out, n, 0.f);
    for (int t = 0; t < k; ++t) {
        const float xt = tf32 ? round_tf32(x[t]) : x[t];
        const float* Bt = B + static_cast<size_t>(t) * n;
        for (int c = 0; c < n; ++c) out[c] += xt * Bt[c];
    }
}

// y[i] += a x[i] for i in [0, n).
inline void axpy(float a, const float* x, float* y, int n) {
    for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

// out[i] += x[i] for i in [0, n).
inline void add_to(float* out, const float* x, int n) {
    for (int i = 0; i < n; ++i) out[i] += x[i];
}

// out[i] *= s for i in [0, n).
inline void scale_by(float* out, float s, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] *= s;
}

// sum_i x[i] y[i], in order.
inline float dot(const float* x, const float* y, int n) {
    float s = 0.f;
    for (int i = 0; i < n; ++i) s += x[i] * y[i];
    return s;
}

// Rows [r0, r1) of A·Bᵀ (A: rows x k, B: n x k, both row-major) into out (row stride n): each row
// a row_times_matrix over a transposed copy of B, accumulating over k in order like a dot product.
inline void rows_times_transposed(const float* A, const float* B, int r0, int r1, int k, int n, float* out,
                                  bool tf32) {
    const std::vector<float> BT = transposed(B, n, k);
    for (int r = r0; r < r1; ++r)
        row_times_matrix(A + static_cast<size_t>(r) * k, BT.data(), k, n, out + static_cast<size_t>(r) * n, tf32);
}

// Rows [c0, c1) of Aᵀ·B (A: rows x cols given entry by entry as a(r, c), B: rows x n, row-major)
// into out (row stride n): out[c] = sum_r a(r, c) B[r], accumulated over r in order. Reads A's rows
// in order, so no transposed copy of A; an entry function lets a stage multiply A by a factor (the
// softcap's derivative, dropout's) on the way without an N x M buffer.
template <typename Entry>
inline void transposed_entries_times_matrix(Entry a, const float* B, int rows, int c0, int c1, int n, float* out,
                                            bool tf32) {
    std::fill(out + static_cast<size_t>(c0) * n, out + static_cast<size_t>(c1) * n, 0.f);
    for (int r = 0; r < rows; ++r) {
        const float* Br = B + static_cast<size_t>(r) * n;
        for (int c = c0; c < c1; ++c) {
            const float x = a(r, c);
            axpy(tf32 ? round_tf32(x) : x, Br, out + static_cast<size_t>(c) * n, n);
        }
    }
}

// The same with A a row-major rows x cols matrix.
inline void transposed_times_matrix(const float* A, const float* B, int rows, int cols, int c0, int c1, int n,
                                    float* out, bool tf32) {
    auto entry = [A, cols](int r, int c) { return A[static_cast<size_t>(r) * cols + c]; };
    transposed_entries_times_matrix(entry, B, rows, c0, c1, n, out, tf32);
}

}  // namespace cpu
}  // namespace attnstep
