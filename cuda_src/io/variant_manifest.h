// variant_manifest.h — the variant's manifest keys (kVariantKeys in variant.h, and kv_heads) as
// the binary reads them from an input manifest.toml, the rules each value must meet (the words of
// verify/variant.py validate, which the command line's options share), and their run.toml lines.
#pragma once

#include <string>

#include "../variant.h"
#include "manifest.h"

namespace attnstep {

struct InputCase;

// Why a value breaks its key's rule (the words after "key = value: "), or "" when it does not.
// verify/variant.py's functions of the same names (kv_heads_problem: verify/files/manifests.py)
// are the twins, in the same words.
std::string kv_heads_problem(long long kv, int heads);  // 1..heads, a divisor of heads
// The widest window side: a 32-bit count of keys (flash-attn's window_size is two ints). Wider
// sees what an unbounded side sees (a dimension is at most kMaxDim), and diag ± bound then stays far
// inside 64 bits, where a bound near 2^63 wraps around (MaskRule::visible).
inline constexpr long long kMaxWindow = 2147483647;
std::string window_bound_problem(long long bound);  // -1 or 0..kMaxWindow
std::string softcap_problem(double cap);
std::string dropout_problem(double p);
std::string dropout_seed_problem(long long seed);
// Why a causal mask cannot have this right bound (a causal mask sees no key right of the
// diagonal), or "".
std::string causal_window_problem(long long right);

// The names a value may take: "top-left"/"bottom-right", "none"/"per-head"/"broadcast"; parse
// returns false on any other text.
const char* align_name(Align a);
const char* coverage_name(Coverage c);
bool parse_align(const std::string& text, Align* out);
bool parse_coverage(const std::string& text, Coverage* out);
// "top-left or bottom-right", "none, per-head or broadcast": the choices, for messages.
std::string align_choices();
std::string coverage_choices();

// Checks the manifest's kv_heads and variant keys (their types were checked with the others):
// each value's rule, kv_heads a divisor of heads. Sets c->dims.kv_heads and c->variant (causal
// from c->causal), and records where window_right and causal came from. Fails with exit 2 naming
// path:line:col, the key and the rule.
void apply_variant_keys(const Manifest& m, InputCase* c);

// Adds kv_heads and every variant key with its value to a run manifest, in kVariantKeys' order.
void add_variant_keys(ManifestWriter& w, int kv_heads, const Variant& v);

}  // namespace attnstep
