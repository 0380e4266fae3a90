// decode_parts.cuh — what the split-KV decode kernels share: decode.cu's (cp.async pipelines, any
// GPU from compute capability 8.0) and sm90a/decode_tma.cu's (tensor memory access, Hopper). The
// block's place and its rows' key ranges, key addressing through the page table, the tensor-core
// step over one chunk of keys (S = Q·Kᵀ, the online softmax, O += P·V) and the merge of the warps'
// states: one copy, so that every kernel does the arithmetic verify/model/kernels.py models as
// `cuda-decode-*`, whichever way its keys reach shared memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>

#include "decode.cuh"
#include "flash_common.cuh"
#include "half_format.cuh"

namespace attnstep {
namespace decode {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kStages = 3;         // chunks in flight per warp
constexpr int kChunkBytes = 4096;  // of K (and of V) per chunk, unless a row is under 128 bytes
constexpr int kSmallTile = kDecodeMinTileRows, kLargeTile = 16;  // rows per block: a decode step's group, or more

// The 16-bit input formats (decode.cu adds F32, the CUDA-core kernel's).
struct B16 {
    using bits = uint16_t;
};
struct H16 {
    using bits = uint16_t;
};

struct RowInfo {
    int lo, hi;     // the keys the row sees, within the block's split
    float slope;    // ALiBi's (0: none)
    int diag;       // the query's diagonal: i + offset
};

// The block's place: its split, K/V head and tile of rows (rho = tile·R + r: query head
// g·group + rho / n, query rho % n of the sequence whose first query row is q0).
struct Tile {
    int split, g, group, n, q0, tile, rows;
    __device__ __forceinline__ int head(int rho) const { return g * group + rho / n; }
    __device__ __forceinline__ int query(int rho) const { return q0 + rho % n; }
};

// The block's place in the grid, one dimension of batch·tiles × splits × kv_heads blocks, the K/V
// head fastest: the blocks that run at once are every K/V head of a few sequences, reading the
// same block-table entries and the same pages in each head's pool, where sequence first had one
// head of many sequences; on an H100 0.4-0.8% faster (docs/performance.md, "Decode").
struct Place {
    int x, split, g;  // x: the sequence's tile (b·tiles + tile)
};
inline dim3 grid_blocks(const DecodeArgs& a, int tiles) {
    return dim3(static_cast<unsigned>(static_cast<long long>(a.batch) * tiles * a.splits * a.kv_heads));
}
__device__ __forceinline__ Place block_place(const DecodeArgs& a) {
    const long long i = blockIdx.x, per_x = static_cast<long long>(a.splits) * a.kv_heads;
    return {static_cast<int>(i / per_x), static_cast<int>(i / a.kv_heads % a.splits), static_cast<int>(i % a.kv_heads)};
}

// The tile's rows: each one's visible keys within [k_lo, k_hi) and ALiBi's terms, into rows_s.
template <int R>
__device__ __forceinline__ void describe_rows(const DecodeArgs& a, const Tile& t, int m, int k_lo, int k_hi,
                                              RowInfo* rows_s) {
    if (threadIdx.x >= R) return;
    const int r = threadIdx.x;
    RowInfo info{0, 0, 0.f, 0};
    if (r < t.rows) {
        const int rho = t.tile * R + r;
        const long long diag = static_cast<long long>(rho % t.n) + (a.bottom_right ? m - t.n : 0);
        const long long first = a.left == kUnbounded ? 0 : diag - a.left;
        const long long end = a.right == kUnbounded ? m : diag + a.right + 1;
        info.lo = static_cast<int>(max(static_cast<long long>(k_lo), first));
        info.hi = static_cast<int>(min(static_cast<long long>(k_hi), end));
        if (info.hi < info.lo) info.hi = info.lo;
        info.slope = a.slopes ? a.slopes[t.head(rho)] : 0.f;
        info.diag = static_cast<int>(diag);
    }
    rows_s[r] = info;
}

// [lo, hi) covering every row's visible keys (lo >= hi: none).
template <int R>
__device__ __forceinline__ void key_range(const RowInfo* rows_s, int rows, int& lo, int& hi) {
    for (int r = 0; r < rows; ++r)
        if (rows_s[r].lo < rows_s[r].hi) {
            lo = min(lo, rows_s[r].lo);
            hi = max(hi, rows_s[r].hi);
        }
}

// The pool row (or packed key row) of key j of sequence b.
__device__ __forceinline__ long long key_row(const DecodeArgs& a, int b, int j) {
    return a.page_size > 0
               ? static_cast<long long>(a.block_table[static_cast<long long>(b) * a.table_stride + j / a.page_size]) *
                         a.page_size + j % a.page_size
               : static_cast<long long>(a.k_begin[b]) + j;
}

// x rounded to the output's format (the combine's rounding: flash_dispatch.cu).
__device__ __forceinline__ float round_output(Precision p, float x) {
    return p == Precision::bf16 ? Bf16::round(x) : p == Precision::fp16 ? Fp16::round(x) : x;
}

// The warps' states merged and stored: O = Σ_w acc_w·e^(m_w − M) / Σ_w l_w·e^(m_w − M) and
// lse = M + log l of every row of the tile, from m_s, l_s [kWarps][R] and acc_s [kWarps][R][D]
// at the start of shared memory. A row that saw no key: O = 0, lse −inf.
template <int D, int R>
__device__ __forceinline__ void store_merged(const DecodeArgs& a, const Tile& t, const char* smem) {
    const float* m_s = reinterpret_cast<const float*>(smem);
    const float* l_s = m_s + kWarps * R;
    const float* acc_s = l_s + kWarps * R;
    for (int e = threadIdx.x; e < t.rows * D; e += kThreads) {
        const int r = e / D, dim = e % D;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, m_s[w * R + r]);
        float l = 0.f, o = 0.f;
        if (mx != -INFINITY)
#pragma unroll
            for (int w = 0; w < kWarps; ++w) {
                const float f = expf(m_s[w * R + r] - mx);
                l += l_s[w * R + r] * f;
                o += acc_s[(w * R + r) * D + dim] * f;
            }
        const int rho = t.tile * R + r;
        const long long row = (static_cast<long long>(t.split) * a.heads + t.head(rho)) * a.total_q + t.query(rho);
        const float out = l > 0.f ? o / l : 0.f;
        a.O_part[row * D + dim] = a.combined ? round_output(a.precision, out) : out;
        if (dim == 0) a.lse_part[row] = l > 0.f ? mx + logf(l) : -INFINITY;
    }
}


// ---------------------------------------------------------------------------------------------
// The half formats on tensor cores (like cp.async, sm_80 and newer: on an older target these compile
// to nothing, and decode_forward refuses the GPU).

template <class Fmt> struct MmaOp;
template <> struct MmaOp<B16> {
    static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifndef ATTNSTEP_NO_CP_ASYNC
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return Bf16::pack(lo, hi); }
};
template <> struct MmaOp<H16> {
    static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifndef ATTNSTEP_NO_CP_ASYNC
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return Fp16::pack(lo, hi); }
};

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p, bool trans) {
#ifdef ATTNSTEP_NO_CP_ASYNC
    r[0] = r[1] = r[2] = r[3] = 0;  // never launched there (decode_forward checks the GPU)
#else
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
    if (trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
#endif
}


// The tensor-core kernels' shape at width D: the MMA's 16 rows (the tile), C keys per chunk (16 or
// 32: 4 KB of K at d128), k-steps over the dimensions, n-tiles of keys and of output dimensions.
template <int D>
struct MmaDims {
    static constexpr int R = kLargeTile;
    static constexpr int kRowBytes = D * 2;
    static constexpr int C = kRowBytes >= 256 ? kChunkBytes / kRowBytes : 32;
    static constexpr int NT = C / 8, KS = D / 16, ND = D / 8;
    static_assert(C % 16 == 0, "a chunk is whole k-steps of P·V");
};

// The block's place in the grid (block_place: the sequence's tile, split, K/V head), its rows
// described into rows_s and its queries into q_s (R×D, the format's bits), then its keys: chunks
// of C from `base` covering every row's visible keys [lo, hi). False: a tile past this sequence's
// rows (its block has nothing to do).
struct MmaBlock {
    Tile t;
    int b = 0, m = 0, lo = INT_MAX, hi = 0, base = 0, chunks = 0;

    template <int D, int C>
    __device__ __forceinline__ bool begin(const DecodeArgs& a, Place place, int tiles, uint16_t* q_s,
                                          RowInfo* rows_s) {
        constexpr int R = kLargeTile;
        b = place.x / tiles;
        const int q0 = a.cu_q[b], n = a.cu_q[b + 1] - q0, group = a.heads / a.kv_heads, tile = place.x % tiles;
        m = a.seqlen_k[b];
        t = Tile{place.split, place.g, group, n, q0, tile, min(R, group * n - tile * R)};
        if (t.rows <= 0) return false;
        const int k_lo = place.split * a.split_size, k_hi = min(m, k_lo + a.split_size);
        describe_rows<R>(a, t, m, k_lo, k_hi, rows_s);
        for (int e = threadIdx.x; e < R * D; e += kThreads) {
            const int r = e / D, rho = tile * R + r;
            q_s[e] = r < t.rows ? static_cast<const uint16_t*>(a.Q)[(static_cast<long long>(t.head(rho)) * a.total_q +
                                                                    t.query(rho)) * D + e % D]
                                : uint16_t(0);
        }
        __syncthreads();
        key_range<R>(rows_s, t.rows, lo, hi);  // none: lo >= hi (past a short sequence's keys)
        base = lo < hi ? lo / C * C : 0;
        chunks = lo < hi ? (hi - base + C - 1) / C : 0;
        return true;
    }
    // The chunks warp w takes (round robin) and the first key of its it-th.
    __device__ __forceinline__ int mine(int w) const { return chunks > w ? (chunks - w + kWarps - 1) / kWarps : 0; }
    __device__ __forceinline__ int key0(int w, int it, int C) const { return base + (w + it * kWarps) * C; }
};

// One warp's online softmax over its chunks, FlashAttention-2's 16-row step on mma.sync m16n8k16:
// S = Q·Kᵀ from K read by ldmatrix, the softmax on S's fragments, P rounded to the format (as the
// flash kernels round it) and O += P·V from V read by ldmatrix.trans. Q's fragments stay in
// registers for the whole split. Lane (gr, tq) holds rows gr and gr + 8.
template <class Fmt, int D>
struct MmaWarp {
    using M = MmaDims<D>;
    using Op = MmaOp<Fmt>;
    uint32_t qa[M::KS][4];
    RowInfo row_a, row_b;
    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f, acc[M::ND][4];
    int gr, tq;
    // Whether any lane's second row (gr + 8) sees a key: a decode step's 4 query heads fill rows 0-3 of
    // 16; rows 8-15 are then padding, whose softmax the warp skips (weights 0 either way: the same bits).
    bool live_b;

    __device__ __forceinline__ void begin(const uint16_t* q_s, const RowInfo* rows_s, int lane) {
        gr = lane / 4;
        tq = lane % 4;
        const uint32_t* q32 = reinterpret_cast<const uint32_t*>(q_s);
#pragma unroll
        for (int ks = 0; ks < M::KS; ++ks) {
            const int c0 = ks * 16 + 2 * tq;
            qa[ks][0] = q32[(gr * D + c0) / 2];
            qa[ks][1] = q32[((gr + 8) * D + c0) / 2];
            qa[ks][2] = q32[(gr * D + c0 + 8) / 2];
            qa[ks][3] = q32[((gr + 8) * D + c0 + 8) / 2];
        }
        row_a = rows_s[gr];
        row_b = rows_s[gr + 8];
        live_b = __any_sync(0xffffffffu, row_b.lo < row_b.hi);
#pragma unroll
        for (int nd = 0; nd < M::ND; ++nd) acc[nd][0] = acc[nd][1] = acc[nd][2] = acc[nd][3] = 0.f;
    }

    // The chunk of keys key0.. in shared memory: at(K or V chunk, key c, 16-byte piece j) is where
    // that piece lies (each kernel's own layout; 8 keys at one piece in 8 different bank groups).
    template <class At>
    __device__ __forceinline__ void chunk(const DecodeArgs& a, const char* k_chunk, const char* v_chunk, int key0,
                                          int lane, At at) {
        float sc[M::NT][4];
#pragma unroll
        for (int nt = 0; nt < M::NT; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
        // S = Q·Kᵀ: n-tiles of 8 keys, in pairs per ldmatrix.x4.
#pragma unroll
        for (int pair = 0; pair < M::NT / 2; ++pair)
#pragma unroll
            for (int ks = 0; ks < M::KS; ++ks) {
                const int mi = lane / 8, c = pair * 16 + (mi / 2) * 8 + lane % 8, j = ks * 2 + mi % 2;
                uint32_t kb[4];
                ldsm_x4(kb, at(k_chunk, c, j), false);
                Op::run(sc[2 * pair], qa[ks], kb[0], kb[1]);
                Op::run(sc[2 * pair + 1], qa[ks], kb[2], kb[3]);
            }
        // The scores as the softmax reads them, masked, and the running max of rows gr, gr + 8.
        float mx_a = -INFINITY, mx_b = -INFINITY;
        auto masked = [&](int nt, int e) {
            const RowInfo& info = e < 2 ? row_a : row_b;
            const int key = key0 + nt * 8 + 2 * tq + (e & 1);
            float x = sc[nt][e] * a.scale;
            if (a.softcap > 0.f) x = a.softcap * tanhf(x / a.softcap);
            if (a.slopes) x -= info.slope * static_cast<float>(abs(info.diag - key));
            return key >= info.lo && key < info.hi ? x : -INFINITY;
        };
        // Rows gr (scores e 0, 1) or gr + 8 (e 2, 3) of the thread's scores: masked, and their max.
        auto scores = [&](int e0, float& mx) {
#pragma unroll
            for (int nt = 0; nt < M::NT; ++nt)
#pragma unroll
                for (int e = e0; e < e0 + 2; ++e) {
                    sc[nt][e] = masked(nt, e);
                    mx = fmaxf(mx, sc[nt][e]);
                }
        };
        scores(0, mx_a);
        if (live_b) scores(2, mx_b);
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, off));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, off));
        }
        const float new_a = fmaxf(m_a, mx_a), new_b = fmaxf(m_b, mx_b);
        // A row whose maximum stayed put rescales by e^0 = 1: where no row of the warp's moved, the
        // rescale is skipped (the same bits), which after a sequence's first keys is most chunks.
        if (__any_sync(0xffffffffu, new_a != m_a || new_b != m_b)) {
            const float alpha_a = new_a == -INFINITY ? 1.f : expf(m_a - new_a);
            const float alpha_b = new_b == -INFINITY ? 1.f : expf(m_b - new_b);
            m_a = new_a;
            m_b = new_b;
            l_a *= alpha_a;
            l_b *= alpha_b;
#pragma unroll
            for (int nd = 0; nd < M::ND; ++nd) {
                acc[nd][0] *= alpha_a;
                acc[nd][1] *= alpha_a;
                acc[nd][2] *= alpha_b;
                acc[nd][3] *= alpha_b;
            }
        }
        // The same rows' weights e^(x − max) and their sums; the padding rows' weights 0.
        auto weights = [&](int e0, float mx, float& l) {
#pragma unroll
            for (int nt = 0; nt < M::NT; ++nt)
#pragma unroll
                for (int e = e0; e < e0 + 2; ++e) {
                    const float x = sc[nt][e], p = x == -INFINITY ? 0.f : expf(x - mx);
                    sc[nt][e] = p;
                    l += p;
                }
        };
        weights(0, new_a, l_a);
        if (live_b) {
            weights(2, new_b, l_b);
        } else {
#pragma unroll
            for (int nt = 0; nt < M::NT; ++nt) sc[nt][2] = sc[nt][3] = 0.f;
        }
        // O += P·V, 16 keys per k-step: P's A fragment is S's C fragments of two n-tiles.
#pragma unroll
        for (int kk = 0; kk < M::C / 16; ++kk) {
            const uint32_t pa[4] = {Op::pack(sc[2 * kk][0], sc[2 * kk][1]), Op::pack(sc[2 * kk][2], sc[2 * kk][3]),
                                    Op::pack(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                                    Op::pack(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
            for (int nd = 0; nd < M::ND; nd += 2) {
                const int mi = lane / 8, c = kk * 16 + (mi % 2) * 8 + lane % 8, j = nd + mi / 2;
                uint32_t vb[4];
                ldsm_x4(vb, at(v_chunk, c, j), true);
                Op::run(acc[nd], pa, vb[0], vb[1]);
                Op::run(acc[nd + 1], pa, vb[2], vb[3]);
            }
        }
    }

    // After every warp is past its chunks (a __syncthreads): this warp's state into the start of
    // shared memory, as store_merged reads it.
    __device__ __forceinline__ void save(char* smem, int warp) {
        constexpr int R = M::R;
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
            l_a += __shfl_xor_sync(0xffffffffu, l_a, off);
            l_b += __shfl_xor_sync(0xffffffffu, l_b, off);
        }
        float* m_s = reinterpret_cast<float*>(smem);
        float* l_s = m_s + kWarps * R;
        float* acc_s = l_s + kWarps * R;
        if (tq == 0) {
            m_s[warp * R + gr] = m_a;
            m_s[warp * R + gr + 8] = m_b;
            l_s[warp * R + gr] = l_a;
            l_s[warp * R + gr + 8] = l_b;
        }
#pragma unroll
        for (int nd = 0; nd < M::ND; ++nd) {
            const int dim = nd * 8 + 2 * tq;
            acc_s[(warp * R + gr) * D + dim] = acc[nd][0];
            acc_s[(warp * R + gr) * D + dim + 1] = acc[nd][1];
            acc_s[(warp * R + gr + 8) * D + dim] = acc[nd][2];
            acc_s[(warp * R + gr + 8) * D + dim + 1] = acc[nd][3];
        }
    }
};

}  // namespace decode
}  // namespace attnstep
