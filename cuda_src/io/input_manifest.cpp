// input_manifest.cpp — an input case's manifest.toml (input_manifest.h): the keys it may hold, each
// with its type, and their values applied to the case.
#include "input_manifest.h"

#include <string>

#include "../backend.h"
#include "../common.h"
#include "../sequences.h"
#include "variant_manifest.h"

namespace attnstep {

namespace {

// The keys of the case itself; the variant's keys (kVariantKeys, variant.h) follow them.
struct KeySpec {
    const char* key;
    KeyType type;
};
const KeySpec kManifestKeys[] = {
    {"batch", KeyType::Int},  {"heads", KeyType::Int},   {"seq_q", KeyType::Int},
    {"seq_k", KeyType::Int},  {"d_k", KeyType::Int},     {"d_v", KeyType::Int},
    {kKvHeadsKey, KeyType::Int},
    {"causal", KeyType::Bool}, {"scale", KeyType::Float}, {"format", KeyType::String},
    {"seed", KeyType::Int},   {"distribution", KeyType::String}, {"generator", KeyType::String},
    {"backward", KeyType::Bool}, {kSequencesKey, KeyType::Int}, {kPageSizeKey, KeyType::Int},
    {kNewKeysKey, KeyType::Int},
};

std::string known_keys() {
    std::string s;
    for (const KeySpec& k : kManifestKeys) s += (s.empty() ? "" : " ") + std::string(k.key);
    for (const VariantKey& k : kVariantKeys) s += " " + std::string(k.key);
    return s;
}

// The type of a known key; null for an unknown one.
const KeyType* key_type(const std::string& key) {
    for (const KeySpec& k : kManifestKeys)
        if (key == k.key) return &k.type;
    for (const VariantKey& k : kVariantKeys)
        if (key == k.key) return &k.type;
    return nullptr;
}

bool type_matches(const ManifestValue& v, KeyType t) {
    switch (t) {
        case KeyType::Int: return v.kind == ManifestValue::Int;
        case KeyType::Float: return v.kind == ManifestValue::Float || v.kind == ManifestValue::Int;
        case KeyType::Bool: return v.kind == ManifestValue::Bool;
        case KeyType::String: return v.kind == ManifestValue::String;
    }
    return false;
}

const char* type_word(KeyType t) {
    switch (t) {
        case KeyType::Int: return "an integer";
        case KeyType::Float: return "a number";
        case KeyType::Bool: return "true or false";
        case KeyType::String: return "a double-quoted string";
    }
    return "?";
}

void check_manifest_keys(const Manifest& m) {
    for (const auto& kv : m.values) {
        const KeyType* type = key_type(kv.first);
        if (!type)
            fail(kExitBadInput, m.path + ":" + std::to_string(m.key_lines.at(kv.first)) +
                                    ":1: unknown key '" + kv.first + "'",
                 "known keys: " + known_keys());
        if (!type_matches(kv.second, *type))
            fail(kExitBadInput, m.where(kv.first) + ": '" + kv.first + "' must be " + type_word(*type));
    }
}

}  // namespace

void apply_input_manifest(const Manifest& m, InputCase* c) {
    check_manifest_keys(m);
    std::string all_dim_keys;
    for (const DimKey& k : kDimKeys) all_dim_keys += (all_dim_keys.empty() ? "" : " ") + std::string(k.key);
    for (const DimKey& k : kDimKeys) {
        const ManifestValue* v = m.find(k.key);
        if (!v)
            fail(kExitBadInput, m.path + ": missing key '" + std::string(k.key) + "'",
                 "a manifest names all of " + all_dim_keys);
        if (v->i < 1 || v->i > kMaxDim)
            fail(kExitBadInput, m.where(k.key) + ": " + k.key + " = " + std::to_string(v->i) +
                                    " is out of range (dimensions are 1.." + std::to_string(kMaxDim) + ")");
        c->dims.*k.field = static_cast<int>(v->i);
    }
    for (const char* k : {"d_k", "d_v"})
        if (m.find(k)->i > kMaxHeadDim)
            fail(kExitBadInput, m.where(k) + ": " + k + " = " + std::to_string(m.find(k)->i) +
                                    " exceeds " + std::to_string(kMaxHeadDim),
                 "head dimensions are 1.." + std::to_string(kMaxHeadDim));
    if (const ManifestValue* v = m.find("causal")) c->causal = v->b;
    if (const ManifestValue* v = m.find("scale")) {
        c->has_scale = true;
        c->scale = v->f;
        if (!scale_fits_float32(v->f))
            fail(kExitBadInput, m.where("scale") + ": scale = " + toml_float(v->f) + ": " + kScaleRangeWords);
    }
    if (const ManifestValue* v = m.find("format"))
        if (!parse_format(v->s, &c->format))
            fail(kExitBadInput, m.where("format") + ": format \"" + v->s + "\" is not \"txt\" or \"npy\"");
    apply_variant_keys(m, c);
}

}  // namespace attnstep
