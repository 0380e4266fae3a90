// backend.h — the one interface both backends implement (cpu/backend_cpu.cpp, cuda/backend_cuda.cu).
// main.cpp streams heads through a backend in groups: it reads a group's Q/K/V (and dO) from the input case
// into host memory, calls compute(), and writes the group's stage files. A backend never touches
// files, so both backends are checked by the same I/O code.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <algorithm>
#include <memory>
#include <string>

#include "stages.h"
#include "variant.h"

namespace attnstep {

struct Sequences;

// What the GEMMs compute in (--precision; verify/stages.py's PRECISIONS is the Python twin).
// fp32 and tf32 keep every value float32 (tf32 rounds the GEMM operands as tensor cores read them);
// bf16 and fp16 are the half pipelines: inputs and every stage value but the row statistics
// (flash_lse, D) are rounded to the format, GEMMs multiply those half values and accumulate in
// float32, the softmax runs in float32 (docs/contract.md).
enum class Precision { fp32, tf32, bf16, fp16 };
inline constexpr const char* kPrecisionNames[] = {"fp32", "tf32", "bf16", "fp16"};
inline constexpr Precision kPrecisions[] = {Precision::fp32, Precision::tf32, Precision::bf16, Precision::fp16};
inline const char* precision_name(Precision p) { return kPrecisionNames[static_cast<int>(p)]; }
inline bool is_half(Precision p) { return p == Precision::bf16 || p == Precision::fp16; }

// x rounded to `mantissa_bits` explicit mantissa bits (float32 has 23), float32's exponent range
// kept, nearest even, as a float32->bf16 conversion does and as tensor cores read TF32 operands: a
// finite value may round up to infinity; Inf and NaN pass through (a NaN stays a NaN). The result
// is the narrower format's value, in float32. The device keeps its own conversions: the CUDA
// intrinsics for bf16 (half_format.cuh), and the flash kernels' TF32 split (flash_common.cuh),
// which rounds ties away from zero as cvt.rna.tf32.f32 does.
inline constexpr int kBf16MantissaBits = 7;
inline constexpr int kTf32MantissaBits = 10;
inline float round_mantissa(float x, int mantissa_bits) {
    const int dropped = 23 - mantissa_bits;
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    if ((u & 0x7F800000u) == 0x7F800000u) return x;
    u += ((1u << (dropped - 1)) - 1u) + ((u >> dropped) & 1u);  // half an ulp, less 1 unless odd
    u &= ~((1u << dropped) - 1u);
    std::memcpy(&x, &u, sizeof u);
    return x;
}
inline float round_bf16(float x) { return round_mantissa(x, kBf16MantissaBits); }
inline float round_tf32(float x) { return round_mantissa(x, kTf32MantissaBits); }

// x rounded to IEEE binary16 (11 significant bits, normal from 2^-14, subnormal steps of 2^-24,
// largest finite 65504), nearest even, as a float32->half conversion does: beyond the range the
// result is +-inf, below it a subnormal or zero. Exact in float32, so the result is the half value.
inline float round_fp16(float x) {
    if (!std::isfinite(x)) return x;
    const float a = std::fabs(x);
    if (a >= 65520.f) return std::copysign(std::numeric_limits<float>::infinity(), x);  // past 65504 + half a step
    int e;
    std::frexp(a, &e);                                   // a = f·2^e, 0.5 <= f < 1
    const int step_exp = std::max(e - 11, -24);          // the half value's ulp: 2^(e-11), at least 2^-24
    const float step = std::ldexp(1.f, step_exp);
    return std::copysign(std::nearbyint(a / step) * step, x);  // exact scaling; nearbyint rounds to even
}

// x rounded to the precision's storage format: the half formats round, fp32 and tf32 keep float32.
inline float round_to(Precision p, float x) {
    return p == Precision::bf16 ? round_bf16(x) : p == Precision::fp16 ? round_fp16(x) : x;
}

// Which FlashAttention kernel the CUDA backend runs: `wgmma` (Hopper, cuda/sm90a/flash_wgmma.cu),
// `fast` (mma.sync tensor cores, cuda/flash_fast.cu), `clean` (plain FP32, cuda/flash_fwd.cu).
// `automatic` takes the fastest that has a variant for the problem and the GPU; forcing one lets
// users verify each.
enum class FlashKernel { automatic, wgmma, fast, clean };

struct Problem {
    Dims dims;
    bool causal = false;       // the same as variant.causal (kept for the kernels that take only it)
    Variant variant;           // alignment, window, softcap, ALiBi, mask/bias files, dropout (variant.h)
    float scale = 0.f;         // multiplies QK; the caller resolves the 1/sqrt(d_k) default
    Precision precision = Precision::fp32;
    bool poison = false;       // pre-fill outputs with NaN so unwritten elements show
    FlashKernel flash_kernel = FlashKernel::automatic;
    // A packed case computed in one call (Backend::computes_packed): the sequences, whose rows the
    // group's matrices hold packed, attention within each. Null: a dense problem (a packed case's
    // sequences are then each one, packed_run.h).
    const Sequences* sequences = nullptr;
    // Keys per split of the split-KV (flash-decoding) stages, --split-size / run.toml split_size;
    // 0: the run does not split, and has no split stages. dims.splits is then split_count().
    int split_size = 0;
};

// The splits S of a run with split size K over key counts whose largest is `max_keys` (a packed
// case: the largest m(b), every sequence split S ways, its later splits empty when it is shorter;
// otherwise M): ceil(max_keys / K), at least 1.
inline int split_count(int max_keys, int split_size) {
    return std::max(1, static_cast<int>((static_cast<long long>(max_keys) + split_size - 1) / split_size));
}

// Problem::scale is a float32, so a scale given as a double (--scale, the manifest's `scale`) is
// usable only when its float32 value is finite and non-zero: 1e39 would become inf, 1e-50 zero.
inline bool scale_fits_float32(double s) {
    float f = static_cast<float>(s);  // IEEE conversion: overflow gives inf, underflow 0
    return std::isfinite(f) && f != 0.f;
}
inline constexpr const char kScaleRangeWords[] =
    "its float32 value must be finite and non-zero (|scale| within about 1.4e-45..3.4e38)";

// How the flash stages are computed: the tile sizes (Br query rows, Bc key rows) and the kernel's
// name, both recorded in run.toml (the verifier uses the tiles to diagnose tile-boundary bugs).
struct FlashPlan {
    int Br = 0, Bc = 0;
    std::string kernel;
};

// The flash kernel's contract: d_k == d_v and one of the widths in kFlashHeadDims (stages.h).
inline bool flash_supported(const Dims& d) {
    if (d.dk != d.dv) return false;
    for (int w : kFlashHeadDims)
        if (d.dk == w) return true;
    return false;
}

// Host memory for one group of consecutive heads [first, first + count). Each buffer holds `count`
// row-major matrices back to back, in the stage table's shape; out[s] is null for stages that are
// not computed. A backend sees one K and V per query head: main.cpp copies a grouped case's K/V
// head to each query head of its group, and sums dK and dV over the group after compute().
struct HeadGroup {
    int first = 0, count = 0;
    const float* q = nullptr;
    const float* k = nullptr;
    const float* v = nullptr;
    const float* dout = nullptr;  // dO, when a backward stage is computed
    // The variant's inputs (variant.h), null when the case has none: `mask` (nonzero keeps) and
    // `bias` are N×M per head, `head_stride` elements apart (0: one matrix broadcast over the
    // heads); alibi_slopes holds one slope per head of the group.
    const float* mask = nullptr;
    long long mask_head_stride = 0;
    const float* bias = nullptr;
    long long bias_head_stride = 0;
    const float* alibi_slopes = nullptr;
    float* out[kNumStages] = {};
};

// Milliseconds spent per stage, summed over groups (device events on the GPU).
struct StageTimes {
    double ms[kNumStages] = {};
};

class Backend {
public:
    virtual ~Backend() = default;
    virtual const char* name() const = 0;          // "cpu" or "cuda"
    virtual std::string device_name() const = 0;   // e.g. "NVIDIA H200" or "host CPU"
    // How the flash stages would be computed for this problem (flash_supported() holds).
    virtual FlashPlan flash_plan(const Problem& p) const = 0;
    // The flash stages it computes for this problem at a half precision (every one where it emulates
    // them; only those of the kernels it has otherwise). flash_supported() holds.
    virtual StageSet half_flash_stages(const Problem& p) const = 0;
    // Working memory the backend needs per head for `computed` (device memory for cuda, extra
    // host memory beyond the HeadGroup buffers for cpu), and what it may use in all.
    virtual size_t working_bytes_per_head(const Problem& p, StageSet computed) const = 0;
    virtual size_t available_bytes() const = 0;
    // Computes every stage in `computed` for the group into group.out. Throws attnstep::Error.
    virtual void compute(const Problem& p, StageSet computed, HeadGroup& group,
                         StageTimes* times) = 0;
    // Whether it computes a packed case's group in one call, p.sequences set and the group's
    // matrices packed, rather than one dense problem per sequence (packed_run.h): where it has a
    // kernel that reads the sequences' rows itself.
    virtual bool computes_packed(const Problem& p, const Sequences& seqs, StageSet computed) const {
        (void)p, (void)seqs, (void)computed;
        return false;
    }
};

std::unique_ptr<Backend> make_cpu_backend();
// Built only with the CUDA backend; without it these report "not built with CUDA".
bool cuda_backend_built();
bool cuda_device_available();
std::unique_ptr<Backend> make_cuda_backend();
// How to get a binary with the CUDA backend, for the hints of a CPU-only build (CMakeLists.txt
// builds CUDA by default only when nvidia-smi lists a GPU at configure time).
inline constexpr const char kHowToBuildCuda[] =
    "rebuild with CUDA: configure on a machine with a GPU (cmake -S . -B build), or compile the CUDA "
    "backend without one (cmake -S . -B build -DATTNSTEP_CUDA=ON; the CUDA toolkit needed), then "
    "cmake --build build";

}  // namespace attnstep
