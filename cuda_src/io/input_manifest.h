// input_manifest.h — an input case's manifest.toml (docs/contract.md): flat `key = value` lines
// naming the case's dimensions and options; a case without one has its shapes inferred from its
// files (case_layout.cpp).
#pragma once

#include "case_layout.h"
#include "manifest.h"

namespace attnstep {

inline constexpr const char* kInputManifestName = "manifest.toml";

// Checks every key of `m` (known, of its type, dimensions in range, the variant's rules) and sets
// c's dimensions (kv_heads too), causal, scale, format and variant from it. Fails with exit 2 naming
// the file, line and key.
void apply_input_manifest(const Manifest& m, InputCase* c);

}  // namespace attnstep
