// cuda_stages.cu — the CUDA backend's stage functions (cuda_stages.cuh): each enqueues one stage
// for every head of a group on the backend's stream, from the stages before it. The half
// pipelines store each stage's values in the format as part of the stage (store_in_format); D
// stays float32, and the flash kernels write their own outputs.
#include <algorithm>
#include <climits>
#include <initializer_list>
#include <string>

#include "../common.h"
#include "../sequences.h"
#include "cuda_stages.cuh"
#include "decode.cuh"
#include "half.cuh"
#include "kernels.cuh"
#include "variant_kernels.cuh"

namespace attnstep {

namespace {

// The arguments both flash passes share, of a whole problem, without buffers. `causal` is the
// plain top-left mask alone (FlashProblem): any other rule is the variant's.
// A packed batch's mask lies within each sequence, where the backend takes it only as the plain
// kind (CudaBackend::computes_packed): its rule is made as a dense problem's with no offset.
FlashProblem flash_problem(const Problem& p) {
    Problem rule_of = p;
    if (p.sequences) rule_of.dims.M = rule_of.dims.N;
    const DeviceVariant v = make_device_variant(rule_of);
    FlashProblem f{nullptr, nullptr, nullptr, p.dims.total_heads(), p.dims.N, p.dims.M, p.dims.dk,
                   p.scale, !v.beyond_plain() && v.top_left_causal(), p.precision, v};
    f.sequences = p.sequences;
    return f;
}

// Whether the stage path runs kernels.cuh's plain kernels (no mask, or the top-left causal one,
// nothing else), and then whether with the causal mask.
bool plain(const DeviceStageWork& w) { return !w.b.variant.beyond_plain(); }
bool plain_causal(const DeviceStageWork& w) { return w.b.variant.has_rule(); }

// The N×M matrices of the group's heads.
size_t group_matrix_elems(const DeviceStageWork& w) {
    return static_cast<size_t>(w.p.dims.N) * w.p.dims.M * w.heads;
}

// The weights the output and dV GEMMs read: attention_weights, or under dropout the dropped
// weights (P∘Z)·(1/(1 − p)) in the scratch matrix.
const float* gemm_weights(const DeviceStageWork& w) {
    if (w.b.variant.dropout <= 0.f) return w.buf(Stage::attention_weights);
    launch_dropped_weights(w.buf(Stage::attention_weights), w.b.variant_at.scratch, w.heads, w.p.dims.N, w.p.dims.M,
                           w.b.variant, w.stream);
    return w.b.variant_at.scratch;
}

// The dS the dQ and dK GEMMs read: dS, or under a softcap dS∘(1 − t²) in the scratch matrix.
const float* gemm_ds(const DeviceStageWork& w) {
    if (w.b.variant.softcap <= 0.f) return w.buf(Stage::dS);
    launch_softcap_grad(w.buf(Stage::dS), w.buf(Stage::QK), w.b.variant_at.scratch, group_matrix_elems(w), w.p.scale,
                        w.b.variant.softcap, w.stream);
    return w.b.variant_at.scratch;
}

}  // namespace

FlashArgs flash_args(const Problem& p) {
    FlashArgs a{flash_problem(p)};
    a.kernel = p.flash_kernel;
    return a;
}

// Whether the run computes only these stages besides the inputs' echoes.
static bool computes_only(StageSet computed, std::initializer_list<Stage> stages) {
    for (int i = 0; i < kNumStages; ++i) {
        const Stage s = static_cast<Stage>(i);
        if (computed.has(s) && !is_input_echo(s) && std::find(stages.begin(), stages.end(), s) == stages.end())
            return false;
    }
    return true;
}

bool packed_flash_available(const Problem& p, const Sequences& seqs, StageSet computed) {
    // A split run: the decode kernel reads each sequence's keys itself, from their slots or through
    // the block table, with its own mask diagonal (flash_splits.cu), under every variant it takes.
    if (p.split_size > 0) {
        const Variant& v = p.variant;
        // The kernel's grid has a block per sequence, tile of its longest sequence's group rows,
        // split and K/V head (decode_forward refuses more than a grid holds).
        int most_q = 0;
        for (int b = 0; b < seqs.count(); ++b) most_q = std::max(most_q, seqs.n(b));
        if (!decode_grid_fits(seqs.count(), static_cast<long long>(p.dims.group_size()) * most_q, kDecodeMinTileRows,
                              p.dims.splits, p.dims.kv()))
            return false;
        return computes_only(computed, {Stage::split_output, Stage::split_lse, Stage::flash_output, Stage::flash_lse}) &&
               p.dims.dk == p.dims.dv && decode_supported(p.dims.dk) && v.mask == Coverage::none &&
               v.bias == Coverage::none && v.dropout == 0.f;
    }
    if (!computes_only(computed, {Stage::flash_output, Stage::flash_lse})) return false;
    if (seqs.paged() || !flash_supported(p.dims)) return false;
    // The plain masks within every sequence: none, or causal with the diagonal at key r in each (a
    // bottom-right one where each sequence has as many keys as queries).
    const Variant& v = p.variant;
    if (v.modifies_scores() || v.mask != Coverage::none || v.dropout > 0.f || v.window_left != kUnbounded ||
        (!v.causal && v.window_right != kUnbounded))
        return false;
    if ((v.causal || p.causal) && v.align == Align::bottom_right)
        for (int b = 0; b < seqs.count(); ++b)
            if (seqs.computed(b) && seqs.n(b) != seqs.m(b)) return false;
    Problem packed = p;
    packed.sequences = &seqs;
    return flash_forward_available(flash_args(packed));
}

FlashBwdArgs flash_bwd_args(const Problem& p) { return FlashBwdArgs{flash_problem(p)}; }

void DeviceStageWork::store_in_format(Stage s) const {
    launch_round_to_format(buf(s), stage_elems(s, p.dims) * heads, p.precision, stream);
}

// ---------------------------------------------------------------- forward

void compute_KT(const DeviceStageWork& w) {
    launch_transpose(w.buf(Stage::K), w.buf(Stage::KT), w.heads, w.p.dims.M, w.p.dims.dk, w.stream);
}

void compute_QK(const DeviceStageWork& w) {
    gemm_qk(w.blas, w.p.dims, w.heads, w.buf(Stage::Q), w.buf(Stage::K), w.buf(Stage::QK), w.b.half);
    w.store_in_format(Stage::QK);
}

void compute_QK_scaled(const DeviceStageWork& w) {
    if (plain(w))
        launch_scale_mask(w.buf(Stage::QK), w.buf(Stage::QK_scaled), w.heads, w.p.dims.N, w.p.dims.M, w.p.scale,
                          plain_causal(w), w.stream);
    else
        launch_variant_scores(w.buf(Stage::QK), w.buf(Stage::QK_scaled), w.heads, w.p.dims.N, w.p.dims.M, w.p.scale,
                              w.b.variant, w.stream);
    w.store_in_format(Stage::QK_scaled);
}

void compute_attention_weights(const DeviceStageWork& w) {
    launch_softmax_rows(w.buf(Stage::QK_scaled), w.buf(Stage::attention_weights),
                        static_cast<long long>(w.heads) * w.p.dims.N, w.p.dims.M, w.stream);
    w.store_in_format(Stage::attention_weights);
}

// The keep-mask is the hash of variant.h, as every stage that applies dropout recomputes it.
void compute_dropout_mask(const DeviceStageWork& w) {
    launch_dropout_mask(w.buf(Stage::dropout_mask), w.heads, w.p.dims.N, w.p.dims.M, w.b.variant, w.stream);
}

void compute_output(const DeviceStageWork& w) {
    gemm_output(w.blas, w.p.dims, w.heads, gemm_weights(w), w.buf(Stage::V), w.buf(Stage::output), w.b.half);
    w.store_in_format(Stage::output);
}

namespace {

// The flash forward's arguments for the group's buffers.
FlashArgs forward_args(const DeviceStageWork& w) {
    FlashArgs a = flash_args(w.p);
    a.Q = w.buf(Stage::Q);
    a.K = w.buf(Stage::K);
    a.V = w.buf(Stage::V);
    a.Qh = w.b.format[0];
    a.Kh = w.b.format[1];
    a.Vh = w.b.format[2];
    a.O = w.buf(Stage::flash_output);
    a.lse = w.buf(Stage::flash_lse);
    a.heads = w.heads;
    // A packed batch keeps flash_args' rule, the plain mask within each sequence: the group's
    // uploaded variant is the packed totals' (a bottom-right offset of total keys − total queries),
    // and a plain mask reads no device input.
    if (!w.p.sequences) a.variant = w.b.variant;
    return a;
}

}  // namespace

// One kernel writes both flash stages; its time is booked to flash_output alone so that the
// per-stage times still add up to the run.
void compute_flash_output(const DeviceStageWork& w) { flash_forward(forward_args(w), w.stream); }

// A run that splits: the split stages and their combine (flash_output, flash_lse), booked to
// split_output, the first of them.
void compute_split_output(const DeviceStageWork& w) {
    FlashSplitArgs a;
    static_cast<FlashArgs&>(a) = forward_args(w);
    a.split_size = w.p.split_size;
    a.splits = w.p.dims.splits;
    a.split_O = w.buf(Stage::split_output);
    a.split_lse = w.buf(Stage::split_lse);
    if (w.p.sequences) {  // the uploaded variant's softcap and slopes; the rest per sequence
        // The window as the case states it: the upload treats a bound past the packed totals as
        // none, but a sequence of a paged case may have more keys than the pool has rows (a page
        // named twice in its table row), and the kernel places each sequence's diagonal itself.
        const MaskRule rule = w.p.variant.rule(0, 0);
        auto bound = [](long long b) { return b == kUnbounded || b > INT_MAX ? kUnbounded : static_cast<int>(b); };
        a.variant = w.b.variant;
        a.variant.left = bound(rule.left);
        a.variant.right = bound(rule.right);
        a.bottom_right = w.p.variant.align == Align::bottom_right;
    }
    compute_flash_splits(a, w.stream);
}

// ---------------------------------------------------------------- backward
// The stage path from dO and the forward's stages (docs/contract.md), and the flash backward
// from the flash forward's outputs.

void compute_D(const DeviceStageWork& w) {
    launch_row_dot(w.buf(Stage::dO), w.buf(Stage::output), w.buf(Stage::D),
                   static_cast<long long>(w.heads) * w.p.dims.N, w.p.dims.dv, w.stream);
}

void compute_dP(const DeviceStageWork& w) {
    gemm_dp(w.blas, w.p.dims, w.heads, w.buf(Stage::dO), w.buf(Stage::V), w.buf(Stage::dP), w.b.half);
    w.store_in_format(Stage::dP);
}

void compute_dS(const DeviceStageWork& w) {
    if (plain(w))
        launch_ds(w.buf(Stage::attention_weights), w.buf(Stage::dP), w.buf(Stage::D), w.buf(Stage::dS), w.heads,
                  w.p.dims.N, w.p.dims.M, plain_causal(w), w.stream);
    else
        launch_variant_ds(w.buf(Stage::attention_weights), w.buf(Stage::dP), w.buf(Stage::D), w.buf(Stage::dS),
                          w.heads, w.p.dims.N, w.p.dims.M, w.b.variant, w.stream);
    w.store_in_format(Stage::dS);
}

void compute_dQ(const DeviceStageWork& w) {
    gemm_dq(w.blas, w.p.dims, w.heads, w.p.scale, gemm_ds(w), w.buf(Stage::K), w.buf(Stage::dQ), w.b.half);
    w.store_in_format(Stage::dQ);
}

void compute_dK(const DeviceStageWork& w) {
    gemm_dk(w.blas, w.p.dims, w.heads, w.p.scale, gemm_ds(w), w.buf(Stage::Q), w.buf(Stage::dK), w.b.half);
    w.store_in_format(Stage::dK);
}

void compute_dV(const DeviceStageWork& w) {
    gemm_dv(w.blas, w.p.dims, w.heads, gemm_weights(w), w.buf(Stage::dO), w.buf(Stage::dV), w.b.half);
    w.store_in_format(Stage::dV);
}

// The three gradients come from one backward pass, booked to flash_dQ.
void compute_flash_dQ(const DeviceStageWork& w) {
    FlashBwdArgs a = flash_bwd_args(w.p);
    a.heads = w.heads;
    a.Q = w.buf(Stage::Q);
    a.K = w.buf(Stage::K);
    a.V = w.buf(Stage::V);
    a.O = w.buf(Stage::flash_output);
    a.lse = w.buf(Stage::flash_lse);
    a.dO = w.buf(Stage::dO);
    a.dQ = w.buf(Stage::flash_dQ);
    a.dK = w.buf(Stage::flash_dK);
    a.dV = w.buf(Stage::flash_dV);
    a.variant = w.b.variant;
    a.Qh = w.b.format[0];  // the half formats' copies (null at fp32 and tf32)
    a.Kh = w.b.format[1];
    a.Vh = w.b.format[2];
    flash_backward(a, w.stream);
}

}  // namespace attnstep
