// cpu_stages.h — the CPU backend's stage functions, one per row of the stage table (stages.h):
// compute_X computes stage X for every head of a group. backend_cpu.cpp calls them through
// kComputeStage; the stage path's are in stage_path.cpp, the flash kernels' in flash_forward.cpp
// and flash_backward.cpp.
#pragma once

#include <cstddef>
#include <vector>

#include "../backend.h"
#include "../stages.h"

namespace attnstep {
namespace cpu {

constexpr int kFlashBr = 64;  // query rows per tile (FlashAttention's Br)
constexpr int kFlashBc = 64;  // key rows per tile (Bc)

// The per-head matrices of one stage inside a group buffer.
struct View {
    float* base;
    size_t per_head;
    float* head(int h) const { return base + per_head * h; }
};

// The group's inputs as the GEMMs read them (rounded copies for TF32).
struct Operands {
    const float *q, *k, *v, *dout;
    // Head h's matrix of input stage s.
    const float* head(Stage s, const Dims& d, size_t h) const {
        const float* base = s == Stage::Q ? q : s == Stage::K ? k : s == Stage::V ? v : dout;
        return base + stage_elems(s, d) * h;
    }
};

// What a stage function works on: the problem, the group (its inputs as read and its stage
// buffers) and the GEMM operands.
struct StageWork {
    const Problem& p;
    HeadGroup& g;
    const Operands& in;
    // Stage s's matrices in the group's buffer (base null where s is not computed).
    View out(Stage s) const { return View{g.out[static_cast<int>(s)], stage_elems(s, p.dims)}; }
};
using StageFunction = void (*)(const StageWork&);

// The stage path (stage_path.cpp).
void compute_Q(const StageWork& w);
void compute_K(const StageWork& w);
void compute_V(const StageWork& w);
void compute_KT(const StageWork& w);
void compute_QK(const StageWork& w);
void compute_QK_scaled(const StageWork& w);
void compute_attention_weights(const StageWork& w);
void compute_dropout_mask(const StageWork& w);
void compute_output(const StageWork& w);
void compute_dO(const StageWork& w);
void compute_D(const StageWork& w);
void compute_dP(const StageWork& w);
void compute_dS(const StageWork& w);
void compute_dQ(const StageWork& w);
void compute_dK(const StageWork& w);
void compute_dV(const StageWork& w);

// The flash forward (flash_forward.cpp) writes flash_output and flash_lse; in a run that splits
// (Problem::split_size) split_output leads the set, and the same function writes split_output,
// split_lse and their combine as flash_output, flash_lse. The flash backward (flash_backward.cpp)
// writes flash_dQ, flash_dK and flash_dV.
void compute_flash_output(const StageWork& w);
constexpr StageFunction compute_split_output = compute_flash_output;
constexpr StageFunction compute_split_lse = nullptr;
constexpr StageFunction compute_flash_lse = nullptr;
void compute_flash_dQ(const StageWork& w);
constexpr StageFunction compute_flash_dK = nullptr;
constexpr StageFunction compute_flash_dV = nullptr;

// D[h·N + r] = dO_r · O_r (width dv) for every query row of every head of the group, from dO as
// read (not a GEMM operand): the D stage, and the flash backward's preprocess.
void row_dots_do_o(const HeadGroup& g, const Dims& d, const View& O, float* D);

}  // namespace cpu
}  // namespace attnstep
