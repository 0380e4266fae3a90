// backend.h — the one interface both backends implement (cpu/backend_cpu.cpp, cuda/backend_cuda.cu).
// main.cpp streams heads through a backend in groups: it reads a group's Q/K/V (and dO) from the input case
// into host memory, calls compute(), and writes the group's stage files. A backend never touches
// files, so both backends are checked by the same I/O code.
#pragma once

#include <cmath>
#include <memory>
#include <string>

#include "stages.h"

namespace attnstep {

enum class Precision { fp32, tf32 };
inline const char* precision_name(Precision p) { return p == Precision::tf32 ? "tf32" : "fp32"; }

// Which FlashAttention kernel the CUDA backend runs: `wgmma` (Hopper, cuda/sm90a/flash_wgmma.cu),
// `fast` (mma.sync tensor cores, cuda/flash_fast.cu), `clean` (plain FP32, cuda/flash_fwd.cu).
// `automatic` takes the fastest that has a variant for the problem and the GPU; forcing one lets
// users verify each.
enum class FlashKernel { automatic, wgmma, fast, clean };

struct Problem {
    Dims dims;
    bool causal = false;       // top-left aligned: query r sees keys c <= r
    float scale = 0.f;         // multiplies QK; the caller resolves the 1/sqrt(d_k) default
    Precision precision = Precision::fp32;
    bool poison = false;       // pre-fill outputs with NaN so unwritten elements show
    FlashKernel flash_kernel = FlashKernel::automatic;
};

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
// not computed.
struct HeadGroup {
    int first = 0, count = 0;
    const float* q = nullptr;
    const float* k = nullptr;
    const float* v = nullptr;
    const float* dout = nullptr;  // dO, when a backward stage is computed
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
    // Working memory the backend needs per head for `computed` (device memory for cuda, extra
    // host memory beyond the HeadGroup buffers for cpu), and what it may use in all.
    virtual size_t working_bytes_per_head(const Problem& p, StageSet computed) const = 0;
    virtual size_t available_bytes() const = 0;
    // Computes every stage in `computed` for the group into group.out. Throws attnstep::Error.
    virtual void compute(const Problem& p, StageSet computed, HeadGroup& group,
                         StageTimes* times) = 0;
};

std::unique_ptr<Backend> make_cpu_backend();
// Built only with the CUDA toolkit; without it these report "not built with CUDA".
bool cuda_backend_built();
bool cuda_device_available();
std::unique_ptr<Backend> make_cuda_backend();

}  // namespace attnstep
