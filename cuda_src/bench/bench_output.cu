// bench_output.cu — what `main --bench` reports: the table on stdout and, with --json, the same
// numbers as JSON (written atomically; verify/bench/report.py reads it).
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "../common.h"
#include "bench_parts.cuh"
#include "../io/variant_manifest.h"

namespace attnstep {
namespace bench {

namespace {

const char* kind_name(Kind k) {
    switch (k) {
        case Kind::memory: return "memory";
        case Kind::gemm: return "gemm";
        case Kind::attention: return "attention";
    }
    return "?";
}

std::string fmt(const char* f, double x) {
    char buf[64];
    std::snprintf(buf, sizeof buf, f, x);
    return buf;
}

// JSON numbers: non-finite values become null (JSON has no inf/nan).
std::string num(double x) { return std::isfinite(x) ? fmt("%.6g", x) : "null"; }
// An error against float64, to the last bit: `attnstep bench` compares it with PyTorch's error on
// the same inputs, and six digits would turn an equal error into a larger one.
std::string exact(double x) { return std::isfinite(x) ? fmt("%.17g", x) : "null"; }

std::string json_escape(const std::string& s) {
    std::string out;
    for (char c : s) {
        if (c == '"' || c == '\\') out += '\\';
        if (static_cast<unsigned char>(c) < 0x20) continue;
        out += c;
    }
    return out;
}

}  // namespace

void print_table(const Options& o, const std::string& device, const BenchRun& run) {
    const Ceilings& c = run.ceilings;
    const int group = run.group, backward_group = run.backward_group;
    const std::vector<Result>& results = run.results;
    std::printf("bench: %s  B=%d H=%d N=%d M=%d d=%d variant: %s  precision=%s  (median of %d, %d warm-up)\n",
                device.c_str(), o.batch, o.heads, o.N, o.M, o.d, variant_text(o).c_str(),
                precision_name(o.precision), o.reps, o.warmup);
    if (c.measured) {
        const std::string gemm = is_half(o.precision) ? std::string("GEMM ") + precision_name(o.precision) : "SGEMM";
        std::printf("ceilings: cuBLAS %s (QK shape) %.1f TFLOP/s, device copy %.0f GB/s, "
                    "mma.sync TF32 %.0f / BF16 %.0f TFLOP/s, wgmma TF32 %.0f TFLOP/s\n",
                    gemm.c_str(), c.sgemm_tflops, c.copy_gbps, c.mma_tf32_tflops, c.mma_bf16_tflops,
                    c.wgmma_tf32_tflops);
    }
    if (group > 0) std::printf("stage path in groups of %s\n", plural(group, "head").c_str());
    if (backward_group > 0)
        std::printf("backward stage path in groups of %s\n", plural(backward_group, "head").c_str());
    std::printf("%-18s %10s %16s %9s  %s\n", "kernel", "ms", "rate", "ceiling", "note");
    for (const Result& r : results) {
        if (r.status != "ok") {
            const std::string note = r.status + (r.reason.empty() ? "" : ": " + r.reason);
            std::printf("%-18s %10s %16s %9s  %s\n", r.name.c_str(), "-", "-", "-", note.c_str());
            continue;
        }
        const std::string rate = r.kind == Kind::memory ? fmt("%.0f GB/s", r.rate) : fmt("%.2f TFLOP/s", r.rate);
        std::string note = r.tiles;
        if (r.checked) {
            note += (note.empty() ? "" : "; ") + std::string(r.backward ? "dQ/dK/dV err " : "max rel err ") +
                    (r.backward ? fmt("%.2e", r.grad_err[0]) + " / " + fmt("%.2e", r.grad_err[1]) + " / " +
                                      fmt("%.2e", r.grad_err[2])
                                : fmt("%.2e", r.max_rel_err)) +
                    (r.check_passed ? " ok" : " FAIL");
        }
        const std::string ceiling = c.measured ? fmt("%.0f%%", 100.0 * r.fraction) : "-";
        std::printf("%-18s %10.4f %16s %9s  %s\n", r.name.c_str(), r.ms, rate.c_str(), ceiling.c_str(), note.c_str());
    }
}

namespace {

// The ceilings as a JSON object: {} under --no-ceilings.
std::string json_ceilings(const Ceilings& c) {
    if (!c.measured) return "{}";
    std::ostringstream js;
    js << "{\"sgemm_ms\": " << num(c.sgemm_ms) << ", \"sgemm_tflops\": " << num(c.sgemm_tflops)
       << ", \"copy_ms\": " << num(c.copy_ms) << ", \"copy_gbps\": " << num(c.copy_gbps)
       << ", \"copy_bytes\": " << num(2.0 * kCopyBytes) << ", \"mma_tf32_tflops\": " << num(c.mma_tf32_tflops)
       << ", \"mma_bf16_tflops\": " << num(c.mma_bf16_tflops)
       << ", \"wgmma_tf32_tflops\": " << num(c.wgmma_tf32_tflops) << "}";
    return js.str();
}

// One kernel row as a JSON object; "pass" says forward or backward, "fraction" is there when the
// ceilings were measured, "check" when the row was compared with float64.
std::string json_kernel(const Result& r, bool ceilings) {
    std::ostringstream js;
    js << "{\"name\": \"" << json_escape(r.name) << "\", \"kind\": \"" << kind_name(r.kind)
       << "\", \"pass\": \"" << (r.backward ? "backward" : "forward") << "\", \"status\": \""
       << json_escape(r.status) << "\"";
    if (!r.reason.empty()) js << ", \"reason\": \"" << json_escape(r.reason) << "\"";
    if (r.status != "ok") return js.str() + "}";
    js << ", \"ms\": " << num(r.ms) << ", \"flops\": " << exact(r.flops) << ", \"bytes\": " << num(r.bytes) << ", \""
       << (r.kind == Kind::memory ? "gbps" : "tflops") << "\": " << num(r.rate);
    if (ceilings) js << ", \"fraction\": " << num(r.fraction);
    if (!r.tiles.empty()) js << ", \"tiles\": \"" << json_escape(r.tiles) << "\"";
    if (r.checked) {
        js << ", \"check\": {\"passed\": " << (r.check_passed ? "true" : "false")
           << ", \"max_rel_err\": " << exact(r.max_rel_err);
        if (r.backward) {
            js << ", \"max_dq_err\": " << exact(r.grad_err[0]) << ", \"max_dk_err\": " << exact(r.grad_err[1])
               << ", \"max_dv_err\": " << exact(r.grad_err[2]);
        } else {
            js << ", \"max_lse_err\": " << exact(r.max_lse_err);
        }
        js << "}";
    }
    return js.str() + "}";
}

// The variant as JSON: the manifest's keys (verify/variant.py VARIANT_KEYS) the bench takes, with
// their values in effect (kv_heads: the K/V heads per batch element, H without GQA), and the
// visible score entries of one head, which the FLOP counts count.
std::string json_variant(const Options& o) {
    const Variant& v = o.variant;
    std::ostringstream js;
    js << "{\"" << kKvHeadsKey << "\": " << bench_dims(o).kv() << ", \"align\": \"" << align_name(v.align)
       << "\", \"window_left\": " << v.window_left << ", \"window_right\": " << v.window_right
       << ", \"softcap\": " << fmt("%.9g", v.softcap) << ", \"alibi\": " << (v.alibi ? "true" : "false")
       << ", \"visible_entries\": " << fmt("%.17g", visible_entries(o)) << "}";
    return js.str();
}

// Which heads and rows --check compared, and the fingerprint of those heads' inputs: what a
// program needs to compare its own output on the same inputs with the same measure.
std::string json_check_sample(const Options& o, const BenchRun& run) {
    auto list = [](const std::vector<int>& v) {
        std::string out = "[";
        for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
        return out + "]";
    };
    return "{\"heads\": " + list(heads_to_check(o, o.batch * o.heads)) + ", \"rows\": " + list(sample_rows(o, o.N)) +
           ", \"inputs_checksum\": " + fmt("%.17g", run.inputs_checksum) + "}";
}

// Written to a temporary name and renamed, so that a reader never sees half a file.
void write_atomically(const std::string& path, const std::string& text) {
    const std::string tmp = path + ".tmp";
    {
        std::ofstream f(tmp, std::ios::binary);
        if (!f) fail(kExitBadInput, "--json: cannot write '" + tmp + "'", "check that the folder exists");
        f << text;
        if (!f.flush()) fail(kExitBadInput, "--json: writing '" + tmp + "' failed");
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
        std::remove(tmp.c_str());
        fail(kExitBadInput, "--json: cannot rename '" + tmp + "' to '" + path + "'");
    }
}

}  // namespace

void write_json(const Options& o, const std::string& device, int sms, const BenchRun& run) {
    const Ceilings& c = run.ceilings;
    const std::vector<Result>& results = run.results;
    std::ostringstream js;
    const std::time_t now = std::time(nullptr);
    char date[32];
    std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    js << "{\n  \"tool\": \"attnstep bench\",\n  \"format\": 1,\n"
       << "  \"device\": \"" << json_escape(device) << "\",\n  \"sm_count\": " << sms << ",\n"
       << "  \"date\": \"" << date << "\",\n"
       << "  \"shape\": {\"batch\": " << o.batch << ", \"heads\": " << o.heads << ", \"seq_q\": " << o.N
       << ", \"seq_k\": " << o.M << ", \"d\": " << o.d << ", \"causal\": " << (o.variant.causal ? "true" : "false")
       << ", \"scale\": " << fmt("%.9g", o.scale) << "},\n"
       << "  \"variant\": " << json_variant(o) << ",\n"
       << "  \"precision\": \"" << precision_name(o.precision) << "\",\n  \"warmup\": " << o.warmup
       << ",\n  \"reps\": " << o.reps << ",\n  \"seed\": " << o.seed << ",\n  \"stage_group_heads\": " << run.group
       << ",\n  \"backward_group_heads\": " << run.backward_group << ",\n"
       << "  \"ceilings\": " << json_ceilings(c) << ",\n"
       << "  \"passed\": " << (run.passed ? "true" : "false") << ",\n";
    if (o.check) js << "  \"check_sample\": " << json_check_sample(o, run) << ",\n";
    js << "  \"kernels\": [\n";
    for (size_t i = 0; i < results.size(); ++i)
        js << "    " << json_kernel(results[i], c.measured) << (i + 1 < results.size() ? "," : "") << "\n";
    js << "  ]\n}\n";
    write_atomically(o.json, js.str());
}

}  // namespace bench
}  // namespace attnstep
