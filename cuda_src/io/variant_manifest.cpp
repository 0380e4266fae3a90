// variant_manifest.cpp — the variant's manifest keys; see variant_manifest.h.
#include "variant_manifest.h"

#include <cmath>
#include <iterator>
#include <limits>

#include "../common.h"
#include "../stages.h"
#include "case_layout.h"

namespace attnstep {

namespace {

template <typename E, size_t K>
bool parse_name(const std::string& text, const char* const (&names)[K], E* out) {
    for (size_t i = 0; i < K; ++i)
        if (text == names[i]) {
            *out = static_cast<E>(i);
            return true;
        }
    return false;
}

template <size_t K>
std::string choices(const char* const (&names)[K]) {
    std::string s;
    for (size_t i = 0; i < K; ++i) s += std::string(i == 0 ? "" : i + 1 == K ? " or " : ", ") + names[i];
    return s;
}

// A value as the verifier's messages show it: strings quoted as Python's repr quotes them.
std::string value_text(const ManifestValue& v) {
    switch (v.kind) {
        case ManifestValue::Int: return std::to_string(v.i);
        case ManifestValue::Float: return toml_float(v.f);
        case ManifestValue::Bool: return v.b ? "true" : "false";
        case ManifestValue::String: return "'" + v.s + "'";
    }
    return "?";
}

// Sets the variant's field named `key` from `v` (of the key's type); returns why the value breaks
// the key's rule, or "".
std::string set_variant_value(const std::string& key, const ManifestValue& v, Variant* out) {
    if (key == "align")
        return parse_align(v.s, &out->align) ? "" : "must be " + align_choices();
    if (key == "window_left" || key == "window_right") {
        (key == "window_left" ? out->window_left : out->window_right) = v.i;
        return window_bound_problem(v.i);
    }
    if (key == "softcap") {
        out->softcap = static_cast<float>(v.f);
        return softcap_problem(v.f);
    }
    if (key == "alibi") {
        out->alibi = v.b;
        return "";
    }
    if (key == "bias" || key == "mask")
        return parse_coverage(v.s, key == "bias" ? &out->bias : &out->mask) ? "" : "must be " + coverage_choices();
    if (key == "dropout") {
        out->dropout = static_cast<float>(v.f);
        return dropout_problem(v.f);
    }
    if (key == "dropout_seed") {
        out->dropout_seed = static_cast<uint64_t>(v.i);
        return dropout_seed_problem(v.i);
    }
    fail(kExitInternal, where(__FILE__, __LINE__) + ": variant key '" + key + "' has no field");
}

// The value of the variant's field named `key`, of the key's type.
ManifestValue variant_value(const std::string& key, const Variant& v) {
    ManifestValue out;
    auto text = [&](const char* s) { out.kind = ManifestValue::String; out.s = s; };
    auto number = [&](double f) { out.kind = ManifestValue::Float; out.f = f; };
    auto integer = [&](long long i) { out.kind = ManifestValue::Int; out.i = i; };
    if (key == "align") text(align_name(v.align));
    else if (key == "window_left") integer(v.window_left);
    else if (key == "window_right") integer(v.window_right);
    else if (key == "softcap") number(v.softcap);
    else if (key == "alibi") { out.kind = ManifestValue::Bool; out.b = v.alibi; }
    else if (key == "bias") text(coverage_name(v.bias));
    else if (key == "mask") text(coverage_name(v.mask));
    else if (key == "dropout") number(v.dropout);
    else if (key == "dropout_seed") integer(static_cast<long long>(v.dropout_seed));
    else fail(kExitInternal, where(__FILE__, __LINE__) + ": variant key '" + key + "' has no field");
    return out;
}

void apply_kv_heads(const Manifest& m, InputCase* c) {
    const ManifestValue* v = m.find(kKvHeadsKey);
    if (!v) return;
    const std::string why = kv_heads_problem(v->i, c->dims.heads);
    if (!why.empty())
        fail(kExitBadInput, m.where(kKvHeadsKey) + ": " + kKvHeadsKey + " = " + std::to_string(v->i) + ": " + why,
             "use a divisor of heads: 1 (one K/V head for all), ..., heads (one each)");
    c->dims.kv_heads = static_cast<int>(v->i);
}

}  // namespace

std::string kv_heads_problem(long long kv, int heads) {
    // 0 too is refused: a manifest that writes kv_heads says how many there are.
    return kv >= 1 && kv <= heads && heads % kv == 0
               ? ""
               : "must be 1..heads and divide heads = " + std::to_string(heads) +
                     " (each K/V head serves heads / kv_heads query heads)";
}

std::string window_bound_problem(long long bound) {
    if (bound >= kUnbounded && bound <= kMaxWindow) return "";
    return "must be -1 (unbounded) or a number of keys from 0 to " + std::to_string(kMaxWindow);
}

std::string softcap_problem(double cap) {
    // The cap is a float32 in the kernels: it must stay finite there too, and not be 0 there (or
    // below float32's smallest normal number, which a kernel may flush to 0): that would be no cap.
    if (!(std::isfinite(cap) && cap >= 0 && std::isfinite(static_cast<float>(cap))))
        return "must be a finite number > 0 (0: none)";
    if (cap > 0 && static_cast<float>(cap) < std::numeric_limits<float>::min())
        return "must be 0 (none) or a positive float32 (at least 1.18e-38)";
    return "";
}

std::string dropout_problem(double p) {
    // Checked as the float32 the kernels compare against: 0.99999999999 would round to 1, and a p
    // below float32's smallest positive number to 0 (no dropout).
    if (!(std::isfinite(p) && p >= 0 && p < 1)) return "must be a probability in [0, 1)";
    if (static_cast<float>(p) >= 1.f) return "must be a probability in [0, 1), below 1 as a float32 (it rounds to 1)";
    if (p > 0 && static_cast<float>(p) == 0.f) return "must be 0 (none) or a positive float32 (at least 1.4e-45)";
    return "";
}

std::string dropout_seed_problem(long long seed) { return seed < 0 ? "must be an integer >= 0" : ""; }

std::string causal_window_problem(long long right) {
    return right == kUnbounded || right == 0 ? ""
                                             : "a causal mask sees no key right of the diagonal (use 0 or -1)";
}

const char* align_name(Align a) { return kAlignNames[static_cast<int>(a)]; }
const char* coverage_name(Coverage c) { return kCoverageNames[static_cast<int>(c)]; }
bool parse_align(const std::string& text, Align* out) { return parse_name(text, kAlignNames, out); }
bool parse_coverage(const std::string& text, Coverage* out) { return parse_name(text, kCoverageNames, out); }
std::string align_choices() { return choices(kAlignNames); }
std::string coverage_choices() { return choices(kCoverageNames); }

void apply_variant_keys(const Manifest& m, InputCase* c) {
    apply_kv_heads(m, c);
    c->variant.causal = c->causal;
    if (m.find("causal")) c->where_causal = m.where("causal") + ": causal = true";
    for (const VariantKey& k : kVariantKeys) {
        const ManifestValue* v = m.find(k.key);
        if (!v) continue;
        const std::string why = set_variant_value(k.key, *v, &c->variant);
        if (!why.empty())
            fail(kExitBadInput, m.where(k.key) + ": " + k.key + " = " + value_text(*v) + ": " + why,
                 "fix the value in manifest.toml (docs/contract.md lists the keys)");
    }
    if (m.find("window_right")) c->where_window_right = m.where("window_right");
}

void add_variant_keys(ManifestWriter& w, int kv_heads, const Variant& v) {
    w.add(kKvHeadsKey, kv_heads);
    for (const VariantKey& k : kVariantKeys) {
        const ManifestValue value = variant_value(k.key, v);
        switch (value.kind) {
            case ManifestValue::Int: w.add(k.key, value.i); break;
            case ManifestValue::Float: w.add_float(k.key, value.f); break;
            case ManifestValue::Bool: w.add_bool(k.key, value.b); break;
            case ManifestValue::String: w.add(k.key, value.s); break;
        }
    }
}

}  // namespace attnstep
