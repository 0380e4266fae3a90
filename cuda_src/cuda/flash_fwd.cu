// flash_fwd.cu — the clean FlashAttention-2 style forward in plain FP32 (the flash_output and
// flash_lse stages; `--flash-kernel clean`, and `auto` where no tensor-core kernel has a variant),
// registered with the dispatcher as flash_clean_ops() (flash_dispatch.cuh). Checked on a GPU by
// scripts/gpu_check.sh against the CPU backend and a float64 NumPy reference.
//
// Algorithm (Dao 2023, Algorithm 1, forward): a block owns Br query rows Qi and walks the Tc key
// tiles Kj, Vj of Bc rows, keeping a running row max m, row sum l and unnormalized output O:
//   S = Qi Kjᵀ · scale (masked to -inf), m_new = max(m, rowmax(S)), P = exp(S - m_new),
//   l = exp(m - m_new)·l + rowsum(P), O = exp(m - m_new)·O + P Vj;  finally O /= l, lse = m + log l.
// N×M is never materialized: S and P live one Br×Bc tile at a time. FP32 CUDA cores, shared-memory
// tiles, 128 threads; Precision::tf32 runs this FP32 kernel too.
// The variant instantiation (flash_problem.cuh) takes every feature of variant.h: the rule's key
// tiles alone (both sides), each score as the CPU backend's HeadScores::score computes it
// (apply_softcap, alibi_bias, the bias file; -inf where hidden), dropout's keep decisions on P as
// it enters P·Vj (l sums the undropped P) and 1/(1 − p) with 1/l at the end; a row that sees no
// key gets O = 0 and lse = -inf.
//
// Arithmetic the verifier assumes (verify/model/kernels.py: KERNELS["cuda-clean"], the CUDA model
// all cuda-* kernels share, looser than this kernel needs): FP32 FMA dot products in a fixed order
// (no tensor cores, no truncation), the scale applied to each finished dot product (one rounding),
// expf (the GPU exp model), lse = m + logf(l), O·(1/l): two final roundings.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "cuda_check.cuh"
#include "device.cuh"
#include "flash_dispatch.cuh"
#include "warp.cuh"

namespace attnstep {

namespace {

constexpr int kFlashThreads = 128;
constexpr int kColLanes = 16;                              // tx: the threads that share a query row (a half-warp)
constexpr int kRowGroups = kFlashThreads / kColLanes;      // ty: 8 groups of rows
static_assert(kColLanes == 16, "a query row's lanes are reduced with half_warp_max/half_warp_sum");

// Tile sizes and shared memory per block, decided here for each head width d:
//   d   Br  Bc  shared memory = 4·(Br·(d+4) + Bc·(d+4) + Bc·d + Br·(Bc+16)) bytes
//   16  64  64  4·(1280 + 1280 + 1024 + 5120) = 34,816 B
//   32  64  64  4·(2304 + 2304 + 2048 + 5120) = 47,104 B
//   64  64  64  4·(4352 + 4352 + 4096 + 5120) = 71,680 B  (above 48 KB: opt-in attribute)
//   128 64  32  4·(8448 + 4224 + 4096 + 3072) = 79,360 B  (Bc halved to keep O in registers)
// Registers per thread hold S (Br/8 × Bc/16) and O (Br/8 × d/16).
template <int D>
struct FlashTile {
    static constexpr int Br = 64;
    static constexpr int Bc = D == 128 ? 32 : 64;
    static constexpr int kRows = Br / kRowGroups;     // query rows per thread: ty + 8·ii
    static constexpr int kCols = Bc / kColLanes;      // S columns per thread: tx + 16·jj
    static constexpr int kDims = D / kColLanes;       // O columns per thread: tx + 16·q
    // Qi and Kj rows padded by 4 floats: the 8 lanes of one float4 shared load touch 8 different
    // 4-bank groups. Ps rows padded by 16: rows r and r+1 (the two half-warps) are 16 banks apart.
    static constexpr int kQKStride = D + 4;
    static constexpr int kPStride = Bc + 16;
    static constexpr size_t kSmemBytes =
        sizeof(float) * (Br * kQKStride + Bc * kQKStride + Bc * D + Br * kPStride);
};
static_assert(FlashTile<16>::kSmemBytes == 34816 && FlashTile<32>::kSmemBytes == 47104 &&
                  FlashTile<64>::kSmemBytes == 71680 && FlashTile<128>::kSmemBytes == 79360,
              "the shared-memory table above is out of date");

// Copies rows [first, first + kTileRows) of a [n_rows][D] matrix into a shared tile with row
// stride `stride`, float4 at a time; rows past n_rows become 0 so tails contribute nothing.
template <int D, int kTileRows>
__device__ void load_tile(float* tile, int stride, const float* src, int first, int n_rows) {
    constexpr int kVecsPerRow = D / 4;
    constexpr int kVecs = kTileRows * kVecsPerRow;
#pragma unroll
    for (int e = threadIdx.x; e < kVecs; e += kFlashThreads) {
        const int r = e / kVecsPerRow, c4 = e % kVecsPerRow;
        const int g = first + r;
        const float4 v = g < n_rows ? reinterpret_cast<const float4*>(src + static_cast<size_t>(g) * D)[c4]
                                    : make_float4(0.f, 0.f, 0.f, 0.f);
        *reinterpret_cast<float4*>(tile + r * stride + c4 * 4) = v;
    }
}

__device__ __forceinline__ float dot4(float4 a, float4 b) {
    return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

// S = Qi Kjᵀ · scale for this thread's rows (ty + 8·ii) and columns (tx + 16·jj).
template <int D>
__device__ void tile_scores(const float* Qi, const float* Kj, float scale, int tx, int ty,
                            float (&S)[FlashTile<D>::kRows][FlashTile<D>::kCols]) {
    using T = FlashTile<D>;
#pragma unroll
    for (int ii = 0; ii < T::kRows; ++ii)
#pragma unroll
        for (int jj = 0; jj < T::kCols; ++jj) S[ii][jj] = 0.f;
#pragma unroll 4
    for (int k = 0; k < D; k += 4) {
        float4 q[T::kRows], kv[T::kCols];
#pragma unroll
        for (int ii = 0; ii < T::kRows; ++ii)
            q[ii] = *reinterpret_cast<const float4*>(Qi + (ty + kRowGroups * ii) * T::kQKStride + k);
#pragma unroll
        for (int jj = 0; jj < T::kCols; ++jj)
            kv[jj] = *reinterpret_cast<const float4*>(Kj + (tx + kColLanes * jj) * T::kQKStride + k);
#pragma unroll
        for (int ii = 0; ii < T::kRows; ++ii)
#pragma unroll
            for (int jj = 0; jj < T::kCols; ++jj) S[ii][jj] += dot4(q[ii], kv[jj]);
    }
#pragma unroll
    for (int ii = 0; ii < T::kRows; ++ii)
#pragma unroll
        for (int jj = 0; jj < T::kCols; ++jj) S[ii][jj] *= scale;
}

// O += P Vj for this thread's rows and output columns (tx + 16·q).
template <int D>
__device__ void accumulate_pv(const float* Ps, const float* Vj, int tx, int ty,
                              float (&O)[FlashTile<D>::kRows][FlashTile<D>::kDims]) {
    using T = FlashTile<D>;
#pragma unroll 2
    for (int c = 0; c < T::Bc; c += 4) {
        float4 p[T::kRows];
#pragma unroll
        for (int ii = 0; ii < T::kRows; ++ii)
            p[ii] = *reinterpret_cast<const float4*>(Ps + (ty + kRowGroups * ii) * T::kPStride + c);
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) {
            float v[T::kDims];
#pragma unroll
            for (int q = 0; q < T::kDims; ++q) v[q] = Vj[(c + cc) * D + tx + kColLanes * q];
#pragma unroll
            for (int ii = 0; ii < T::kRows; ++ii)
#pragma unroll
                for (int q = 0; q < T::kDims; ++q) O[ii][q] += lane_of(p[ii], cc) * v[q];
        }
    }
}

// The variant's scores (flash_problem.cuh: the variant instantiation) for this thread's rows and
// columns of head h, from S = scale·Qi Kjᵀ: capped, ALiBi, the bias file, and -inf where hidden
// (DeviceVariant::hidden), past the last key, or in a row past N (never stored; its mask and bias
// entries do not exist). As the CPU backend's HeadScores::score.
template <int D>
__device__ __forceinline__ void variant_scores(float (&S)[FlashTile<D>::kRows][FlashTile<D>::kCols],
                                               const DeviceVariant& v, int h, int row0, int key0, int N, int M, int tx,
                                               int ty) {
    using T = FlashTile<D>;
    const float slope = v.slope(h);
#pragma unroll
    for (int ii = 0; ii < T::kRows; ++ii) {
        const int r = row0 + ty + kRowGroups * ii;
#pragma unroll
        for (int jj = 0; jj < T::kCols; ++jj) {
            const int c = key0 + tx + kColLanes * jj;
            if (r >= N || c >= M || v.hidden(h, r, c, M)) {
                S[ii][jj] = -INFINITY;
                continue;
            }
            float x = apply_softcap(S[ii][jj], v.softcap);
            if (v.slopes) x += alibi_bias(slope, r, c, v.rule());
            if (v.bias) x += v.file_bias(h, r, c, M);
            S[ii][jj] = x;
        }
    }
}

// -inf for this thread's scores past the last key (c >= M) and above the diagonal (c > r).
template <int D>
__device__ __forceinline__ void mask_scores(float (&S)[FlashTile<D>::kRows][FlashTile<D>::kCols], int row0, int key0,
                                            int M, bool causal, int tx, int ty) {
    using T = FlashTile<D>;
#pragma unroll
    for (int ii = 0; ii < T::kRows; ++ii) {
        const int r = row0 + ty + kRowGroups * ii;
#pragma unroll
        for (int jj = 0; jj < T::kCols; ++jj) {
            const int c = key0 + tx + kColLanes * jj;
            if (c >= M || (causal && c > r)) S[ii][jj] = -INFINITY;
        }
    }
}

// The online softmax of one tile for this thread's rows: m_new = max(m, rowmax(S)),
// P = exp(S - m_new) into Ps (the P·Vj product reads other lanes' columns), l = exp(m - m_new)·l +
// rowsum(P), O = exp(m - m_new)·O. The 16 lanes of a row (a half-warp) reduce together.
// kDropout: Ps takes P∘Z (Z the keep decisions of head h's entries from row0, key0), while l sums
// P: dropout drops weights after the softmax, whose denominator it leaves alone.
template <int D, bool kDropout = false>
__device__ __forceinline__ void online_softmax(const float (&S)[FlashTile<D>::kRows][FlashTile<D>::kCols],
                                               float (&m)[FlashTile<D>::kRows], float (&l)[FlashTile<D>::kRows],
                                               float (&Oacc)[FlashTile<D>::kRows][FlashTile<D>::kDims], float* Ps,
                                               int tx, int ty, const DeviceVariant* v = nullptr, int h = 0,
                                               int row0 = 0, int key0 = 0, int M = 0) {
    using T = FlashTile<D>;
#pragma unroll
    for (int ii = 0; ii < T::kRows; ++ii) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int jj = 0; jj < T::kCols; ++jj) tile_max = fmaxf(tile_max, S[ii][jj]);
        const float m_new = fmaxf(m[ii], half_warp_max(tile_max));
        // A row with every key so far masked keeps m = -inf; subtracting 0 then gives P = 0 and
        // alpha = 0 instead of NaN from (-inf) - (-inf).
        const float m_sub = m_new == -INFINITY ? 0.f : m_new;
        float p_sum = 0.f;
#pragma unroll
        for (int jj = 0; jj < T::kCols; ++jj) {
            const float p = expf(S[ii][jj] - m_sub);
            p_sum += p;
            const float z = kDropout && !v->keep(h, row0 + ty + kRowGroups * ii, key0 + tx + kColLanes * jj, M) ? 0.f : 1.f;
            Ps[(ty + kRowGroups * ii) * T::kPStride + tx + kColLanes * jj] = kDropout ? p * z : p;
        }
        const float alpha = expf(m[ii] - m_sub);
        l[ii] = alpha * l[ii] + half_warp_sum(p_sum);
#pragma unroll
        for (int q = 0; q < T::kDims; ++q) Oacc[ii][q] *= alpha;
        m[ii] = m_new;
    }
}

// O /= l, lse = m + log(l) for this thread's rows of the head's O [N][D] and lse [N]; tail rows
// (r >= N) are never written. kVariant: O·(keep_scale/l) (dropout's 1/(1 − p) with 1/l, as
// FlashAttention does; keep_scale 1 without dropout), and a row that saw no key (l = 0) gets O = 0
// and lse = -inf, not the NaN of 0/0 (a NaN score leaves l NaN, and the row NaN).
template <int D, bool kVariant = false>
__device__ __forceinline__ void store_rows(const float (&Oacc)[FlashTile<D>::kRows][FlashTile<D>::kDims],
                                           const float (&m)[FlashTile<D>::kRows], const float (&l)[FlashTile<D>::kRows],
                                           float* O, float* lse, int row0, int N, int tx, int ty,
                                           float keep_scale = 1.f) {
    using T = FlashTile<D>;
#pragma unroll
    for (int ii = 0; ii < T::kRows; ++ii) {
        const int r = row0 + ty + kRowGroups * ii;
        if (r >= N) continue;
        const bool none = kVariant && l[ii] == 0.f;
        const float inv_l = kVariant ? (none ? 0.f : keep_scale / l[ii]) : 1.f / l[ii];
        float* Or = O + static_cast<size_t>(r) * D;
#pragma unroll
        for (int q = 0; q < T::kDims; ++q) Or[tx + kColLanes * q] = Oacc[ii][q] * inv_l;
        if (tx == 0) lse[r] = none ? -INFINITY : m[ii] + logf(l[ii]);
    }
}

// Grid: x = Tr query tiles, y = heads (grid-stride, so any number of heads fits). kVariant: the
// case's variant `v` (flash_problem.cuh), every feature of it: the rule's key tiles alone are
// visited, and each score goes through variant_scores; `causal` is false then.
template <int D, bool kVariant>
__global__ void __launch_bounds__(kFlashThreads)
flash_fwd_kernel(const float* __restrict__ Q, const float* __restrict__ K,
                 const float* __restrict__ V, float* __restrict__ O, float* __restrict__ lse,
                 int heads, int N, int M, float scale, bool causal, const __grid_constant__ DeviceVariant v) {
    using T = FlashTile<D>;
    constexpr int Br = T::Br, Bc = T::Bc;
    extern __shared__ float4 smem4[];  // float4: 16-byte alignment for the vector accesses
    float* Qi = reinterpret_cast<float*>(smem4);  // [Br][d+4]
    float* Kj = Qi + Br * T::kQKStride;           // [Bc][d+4]
    float* Vj = Kj + Bc * T::kQKStride;           // [Bc][d]
    float* Ps = Vj + Bc * D;                      // [Br][Bc+16]

    const int tx = threadIdx.x % kColLanes, ty = threadIdx.x / kColLanes;
    const int i = blockIdx.x;  // this block's query tile
    const int row0 = i * Br;
    const int Tc = (M + Bc - 1) / Bc;
    // Causal: key tile j is entirely above the diagonal (skipped) when its first column lies past
    // the last real row of this query tile.
    const int last_row = min(row0 + Br, N) - 1;
    const int Tc_visible = causal ? min(Tc, last_row / Bc + 1) : Tc;
    // The variant: the key tiles of [first_key(row0), end_key(last_row)), every row's range.
    const int j_begin = kVariant ? v.first_key(row0) / Bc : 0;
    const int j_end = kVariant ? (v.end_key(last_row, M) + Bc - 1) / Bc : Tc_visible;

    for (int h = blockIdx.y; h < heads; h += gridDim.y) {
        const float* Qh = Q + static_cast<size_t>(h) * N * D;
        const float* Kh = K + static_cast<size_t>(h) * M * D;
        const float* Vh = V + static_cast<size_t>(h) * M * D;
        // Qi's previous readers (tile_scores of the last head) all passed the barrier after
        // their last S, so Qi may be overwritten here.
        load_tile<D, Br>(Qi, T::kQKStride, Qh, row0, N);

        float m[T::kRows], l[T::kRows], Oacc[T::kRows][T::kDims];
#pragma unroll
        for (int ii = 0; ii < T::kRows; ++ii) {
            m[ii] = -INFINITY;
            l[ii] = 0.f;
#pragma unroll
            for (int q = 0; q < T::kDims; ++q) Oacc[ii][q] = 0.f;
        }

        for (int j = j_begin; j < j_end; ++j) {
            __syncthreads();  // every read of the previous Kj, Vj and Ps is done before reloading
            load_tile<D, Bc>(Kj, T::kQKStride, Kh, j * Bc, M);
            load_tile<D, Bc>(Vj, D, Vh, j * Bc, M);
            __syncthreads();  // Qi, Kj and Vj are complete in shared memory

            // S = Qi Kjᵀ · scale; -inf past the last key (c >= M) and above the diagonal (c > r).
            float S[T::kRows][T::kCols];
            tile_scores<D>(Qi, Kj, scale, tx, ty, S);
            if constexpr (kVariant) {
                variant_scores<D>(S, v, h, row0, j * Bc, N, M, tx, ty);
                if (v.dropout > 0.f) online_softmax<D, true>(S, m, l, Oacc, Ps, tx, ty, &v, h, row0, j * Bc, M);
                else online_softmax<D>(S, m, l, Oacc, Ps, tx, ty);
            } else {
                mask_scores<D>(S, row0, j * Bc, M, causal, tx, ty);
                online_softmax<D>(S, m, l, Oacc, Ps, tx, ty);
            }
            __syncthreads();  // Ps is complete before threads read other lanes' columns of it

            // O += P Vj
            accumulate_pv<D>(Ps, Vj, tx, ty, Oacc);
        }

        store_rows<D, kVariant>(Oacc, m, l, O + static_cast<size_t>(h) * N * D, lse + static_cast<size_t>(h) * N, row0, N,
                                tx, ty, kVariant ? v.inv_keep() : 1.f);
    }
}

template <int D, bool kVariant>
void launch_flash_fwd(const FlashArgs& a, cudaStream_t stream) {
    using T = FlashTile<D>;
    static const int prepared = prepare_kernel(reinterpret_cast<const void*>(flash_fwd_kernel<D, kVariant>),
                                               kFlashThreads, T::kSmemBytes);
    (void)prepared;
    const long long Tr = (static_cast<long long>(a.N) + T::Br - 1) / T::Br;
    const dim3 grid(static_cast<unsigned>(Tr), static_cast<unsigned>(std::min(a.heads, kMaxGridYZ)));
    flash_fwd_kernel<D, kVariant><<<grid, kFlashThreads, T::kSmemBytes, stream>>>(
        a.Q, a.K, a.V, a.O, a.lse, a.heads, a.N, a.M, a.scale, a.causal, a.variant);
    LAUNCH_CHECK(flash_fwd_kernel);
}

bool plan_clean(const FlashArgs& a, int, KernelPlan* plan) {
    if (is_half(a.precision)) return false;  // float32 arithmetic: no half-precision variant
    return with_head_dim(a.d, [&](auto D) {
        *plan = KernelPlan{FlashTile<constant_v<decltype(D)>>::Br, FlashTile<constant_v<decltype(D)>>::Bc};
        return true;
    });
}

void launch_clean(const FlashArgs& a, const KernelPlan&, cudaStream_t stream) {
    with_head_dim(a.d, [&](auto D) {
        with_flag(a.variant.beyond_plain(), [&](auto variant) {
            launch_flash_fwd<constant_v<decltype(D)>, constant_v<decltype(variant)>>(a, stream);
        });
        return true;
    });
}

}  // namespace

const FlashKernelOps& flash_clean_ops() {
    static const FlashKernelOps ops{FlashKernel::clean, "clean", false, nullptr, plan_clean, launch_clean};
    return ops;
}

}  // namespace attnstep
