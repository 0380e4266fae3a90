// flash_bwd_wgmma_half.cu — FlashAttention-2 backward on Hopper's warpgroup MMA (wgmma, sm_90a)
// with bf16 or fp16 operands and FP32 accumulation (--precision bf16|fp16), in the deterministic
// two-kernel form of flash_bwd.cu: no N×M buffer, no atomics, so two runs give the same bytes.
//
// The kernels are flash_bwd_wgmma_kernels.cuh's, with 16-bit operands (HalfOps): K and V owned 128
// a block, query tiles of 64 rows streamed (the dQ kernel the transpose), the second GEMMs' B
// operand read MN-major as the tiles lie, and at d64 the next tile's Sᵀ and dPᵀ issued before this
// tile's dV, dK group is waited for. Their variant instantiation takes the rule of either causal
// alignment and sliding windows (the tiles of its range alone), the softcap and ALiBi; mask or bias
// files and dropout are left to the stage path. This file holds the preparation pass and the launch:
//   0. One pass over dO: dO to the format (a run's inputs already hold the format's values; a
//      caller's float32 dO is rounded), and per query row D = rowsum(dO∘O) of that rounded dO and
//      lse·log2 e, padded to whole query blocks (+inf and 0 past N, so a tail row's P is exactly 0).
//
// The arithmetic, which the verifier's model of the half pipeline bounds (as it bounds the CPU
// backend's emulation, cuda_src/cpu/flash_backward.cpp): half products exact, summed in FP32 by
// the tensor cores with truncation; scale·log2 e and lse·log2 e each rounded once, the exponent one
// FFMA, ex2.approx.ftz; P and dS rounded to the format as GEMM operands (FlashAttention's order),
// dS = P·(dP − D) in FP32; dK and dQ times the scale once at the end; every gradient rounded to
// the format once as it is stored. The variant's scores as the half forward makes them: under a
// softcap t = tanh.approx(s·scale/C) and C·log2 e·t rounded, ALiBi's slope·|diag − key| by an FMA,
// then x − lse·log2 e rounded before ex2.approx.ftz; dS = P·(1 − t²)·(dP − D).
//
// Build: sm_90a only (CMakeLists.txt, the attnstep_sm90a object library); resources:
//   nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -Icuda_src -Xptxas -v -c cuda_src/cuda/sm90a/flash_bwd_wgmma_half.cu
// Time / check: build/main --bench --pass backward --precision bf16 --batch 4 --heads 16 --seq-q 4096 --seq-k 4096 --d 128 --check
#include "flash_bwd_wgmma_half.cuh"

#include <algorithm>
#include <cstdint>

#include "../cuda_check.cuh"
#include "../device.cuh"
#include "../flash_common.cuh"
#include "../flash_dispatch.cuh"
#include "../half_format.cuh"
#include "../warp.cuh"
#include "flash_bwd_wgmma_kernels.cuh"

namespace attnstep {
namespace {

using namespace flash;
using namespace wgbwd;

template <int D, int NWG, class Fmt>
using HalfTiles = BwdTiles<D, NWG, 64, HalfOps<Fmt>>;

// The workspace of a launch: dO in the format, then lse₂ and D, 16-byte aligned each.
struct Workspace {
    size_t dO_floats, row_floats;
    Workspace(const FlashBwdArgs& a, int heads, int n_pad)
        : dO_floats((static_cast<size_t>(heads) * a.N * a.d / 2 + 3) / 4 * 4),
          row_floats(static_cast<size_t>(heads) * n_pad) {}
    size_t floats() const { return dO_floats + 2 * row_floats; }
};

template <class T, bool kCausal, bool kVariant>
void launch_tiles(const FlashBwdArgs& a, cudaStream_t stream) {
    const int n_pad = padded_rows<T>(a.N);
    const Workspace sizes(a, a.heads, n_pad);
    StreamWorkspace ws(sizes.floats(), stream);
    uint16_t* dOh = reinterpret_cast<uint16_t*>(ws.p);
    float* lse2 = ws.p + sizes.dO_floats;
    float* Drow = lse2 + sizes.row_floats;
    const long long rows = static_cast<long long>(a.heads) * n_pad;
    const int blocks = static_cast<int>(std::min<long long>((rows + 7) / 8, 64LL * device_sm_count()));
    rows_kernel<typename T::Fmt><<<blocks, 256, 0, stream>>>(a.dO, a.O, a.lse, lse2, Drow, dOh, rows, a.N, n_pad, a.d);
    LAUNCH_CHECK(rows_kernel);
    // L2 fetches each 128-byte row a copy reads and no more: with the 256-byte promotion the d64
    // backward took 2.5% longer on an H200 (docs/performance.md, "Decode"); d128 the same either way.
    const auto map = [&](const void* p, int rows, int box) {
        return tma::rows_map(p, T::D, rows, a.heads, box, 2, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
    };
    const BwdMaps by_keys{map(a.Qh, a.N, T::STREAM), map(a.Kh, a.M, T::OWN), map(a.Vh, a.M, T::OWN),
                          map(dOh, a.N, T::STREAM)};
    const BwdMaps by_rows{map(a.Qh, a.N, T::OWN), map(a.Kh, a.M, T::STREAM), map(a.Vh, a.M, T::STREAM),
                          map(dOh, a.N, T::OWN)};
    launch_kernels<T, kCausal, kVariant>(a, by_keys, by_rows, lse2, Drow, n_pad, stream);
    ws.release();
}

// Consumer warpgroups at d64 (d128: two, as its accumulators need the registers of two). Three
// (192 keys or rows a block, no overlap of tiles) measured 4% faster unmasked and 2% slower causal
// on an H100 (B4 H16 N = M = 4096, bf16): not worth a second configuration.
constexpr int kWarpgroupsD64 = 2;

// Calls f(TypeTag<T>{}) with a's tiles; false for a width or precision without them.
template <class F>
bool with_tiles(const FlashBwdArgs& a, F&& f) {
    if (!is_half(a.precision) || (a.d != 64 && a.d != 128)) return false;
    return with_half_format(a.precision, [&](auto fmt) {
        if (a.d == 64) f(TypeTag<HalfTiles<64, kWarpgroupsD64, decltype(fmt)>>{});
        else f(TypeTag<HalfTiles<128, 2, decltype(fmt)>>{});
        return true;
    });
}

}  // namespace

bool wgmma_half_backward_takes(const FlashBwdArgs& a) {
    return !a.sequences && !a.variant.per_element_inputs() && with_tiles(a, [](auto) {});
}

size_t wgmma_half_backward_workspace_bytes_per_head(const FlashBwdArgs& a) {
    size_t bytes = 0;
    with_tiles(a, [&](auto tag) {
        using T = tag_type<decltype(tag)>;
        bytes = Workspace(a, 1, padded_rows<T>(a.N)).floats() * sizeof(float) + 16;
    });
    return bytes;
}

void wgmma_half_backward(const FlashBwdArgs& a, cudaStream_t stream) {
    if (!aligned16(a.Qh) || !aligned16(a.Kh) || !aligned16(a.Vh))
        fail(kExitInternal, where(__FILE__, __LINE__) +
                                ": the half-precision flash backward needs Q, K and V in the format, 16-byte aligned");
    with_tiles(a, [&](auto tag) {
        using T = tag_type<decltype(tag)>;
        with_mask_kind(a, [&](auto causal, auto variant) {
            launch_tiles<T, constant_v<decltype(causal)>, constant_v<decltype(variant)>>(a, stream);
        });
    });
}

}  // namespace attnstep
