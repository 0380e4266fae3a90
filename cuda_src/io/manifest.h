// manifest.h — the flat `key = value` subset of TOML both languages read without extra
// dependencies (docs/contract.md): one key per line, '#' comments, values that are integers,
// floats, true/false or double-quoted strings. Python's tomllib reads everything written here.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace attnstep {

struct ManifestValue {
    enum Kind { Int, Float, Bool, String } kind = Int;
    long long i = 0;
    double f = 0;  // also set for Int, so a float key accepts "1"
    bool b = false;
    std::string s;
    int line = 0, col = 0;  // where the value starts, for error messages
};

struct Manifest {
    std::string path;
    std::map<std::string, ManifestValue> values;
    std::map<std::string, int> key_lines;
    const ManifestValue* find(const std::string& key) const {
        auto it = values.find(key);
        return it == values.end() ? nullptr : &it->second;
    }
    // "<path>:<line>:<col>" of a key's value.
    std::string where(const std::string& key) const;
};

// Parses the syntax only (regular files only, input_file.h) (which keys are allowed is the caller's business). Errors: exit 2,
// naming path:line:col.
Manifest read_manifest(const std::string& path);

// Builds a manifest's text in insertion order.
class ManifestWriter {
public:
    void comment(const std::string& text) { out_ += "# " + text + "\n"; }
    void add(const std::string& key, long long v);
    void add(const std::string& key, int v) { add(key, static_cast<long long>(v)); }
    void add_float(const std::string& key, double v);
    void add_bool(const std::string& key, bool v);
    void add(const std::string& key, const std::string& v);
    void add(const std::string& key, const char* v) { add(key, std::string(v)); }
    const std::string& text() const { return out_; }

private:
    std::string out_;
};

// A TOML basic string holding `v` (UTF-8), in ASCII: other characters as \uXXXX / \UXXXXXXXX escapes,
// bytes that are not UTF-8 as U+FFFD.
std::string toml_string(const std::string& v);

// A TOML float literal that round-trips a float32/64 and always reads back as a float.
std::string toml_float(double v);

}  // namespace attnstep
