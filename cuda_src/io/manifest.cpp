// manifest.cpp — reading and writing the flat TOML subset; see manifest.h.
#include "manifest.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "../common.h"

namespace attnstep {

namespace {

const char* kSyntaxHint = "manifest lines are `key = value` (integers, floats, true/false, \"strings\")";

std::string at(const std::string& path, int line, int col) {
    return path + ":" + std::to_string(line) + ":" + std::to_string(col);
}

bool is_key_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-'; }

// Parses the value starting at text[p]; leaves p after it.
ManifestValue parse_value(const std::string& path, int line, const std::string& text, size_t& p) {
    ManifestValue v;
    v.line = line;
    v.col = static_cast<int>(p) + 1;
    if (p >= text.size())
        fail(kExitBadInput, at(path, line, v.col) + ": missing value", kSyntaxHint);
    if (text[p] == '"') {
        v.kind = ManifestValue::String;
        ++p;
        while (p < text.size() && text[p] != '"') {
            char c = text[p++];
            if (c == '\\') {
                if (p >= text.size()) break;
                char e = text[p++];
                switch (e) {
                    case '"': v.s += '"'; break;
                    case '\\': v.s += '\\'; break;
                    case 'n': v.s += '\n'; break;
                    case 't': v.s += '\t'; break;
                    default:
                        fail(kExitBadInput, at(path, line, static_cast<int>(p) - 1) +
                                                ": unsupported escape '\\" + std::string(1, e) + "'",
                             kSyntaxHint);
                }
            } else {
                v.s += c;
            }
        }
        if (p >= text.size())
            fail(kExitBadInput, at(path, line, v.col) + ": unterminated string", kSyntaxHint);
        ++p;  // closing quote
        return v;
    }
    size_t b = p;
    while (p < text.size() && text[p] != ' ' && text[p] != '\t' && text[p] != '#') ++p;
    std::string tok = text.substr(b, p - b);
    if (tok == "true" || tok == "false") {
        v.kind = ManifestValue::Bool;
        v.b = tok == "true";
        return v;
    }
    char* end = nullptr;
    errno = 0;
    long long i = std::strtoll(tok.c_str(), &end, 10);
    if (!tok.empty() && *end == '\0' && errno == 0) {
        v.kind = ManifestValue::Int;
        v.i = i;
        v.f = static_cast<double>(i);
        return v;
    }
    double f = std::strtod(tok.c_str(), &end);
    if (!tok.empty() && *end == '\0' && std::isfinite(f)) {
        v.kind = ManifestValue::Float;
        v.f = f;
        return v;
    }
    if (tok == "inf" || tok == "+inf" || tok == "-inf" || tok == "nan") {
        v.kind = ManifestValue::Float;
        v.f = std::strtod(tok.c_str(), nullptr);
        return v;
    }
    fail(kExitBadInput, at(path, line, v.col) + ": cannot read value '" + tok + "'", kSyntaxHint);
}

}  // namespace

std::string Manifest::where(const std::string& key) const {
    const ManifestValue* v = find(key);
    return v ? at(path, v->line, v->col) : path;
}

Manifest read_manifest(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) fail(kExitBadInput, path + ": cannot open: " + std::strerror(errno));
    Manifest m;
    m.path = path;
    std::string text;
    int line = 0;
    while (std::getline(in, text)) {
        ++line;
        if (!text.empty() && text.back() == '\r') text.pop_back();
        // The manifest is ASCII without control characters (tabs aside), comments included: the
        // verifier's TOML reader refuses them, and the two readers must agree on what is valid.
        for (size_t i = 0; i < text.size(); ++i) {
            unsigned char c = static_cast<unsigned char>(text[i]);
            if ((c < 0x20 && c != '\t') || c >= 0x7F) {
                char code[8];
                std::snprintf(code, sizeof code, "0x%02X", c);
                fail(kExitBadInput, at(path, line, static_cast<int>(i) + 1) + ": byte " + code +
                                        " in the manifest (ASCII text only)", kSyntaxHint);
            }
        }
        size_t p = 0;
        while (p < text.size() && (text[p] == ' ' || text[p] == '\t')) ++p;
        if (p >= text.size() || text[p] == '#') continue;
        if (text[p] == '[')
            fail(kExitBadInput, at(path, line, static_cast<int>(p) + 1) +
                                    ": tables are not supported in the manifest", kSyntaxHint);
        size_t kb = p;
        while (p < text.size() && is_key_char(text[p])) ++p;
        std::string key = text.substr(kb, p - kb);
        if (key.empty())
            fail(kExitBadInput, at(path, line, static_cast<int>(kb) + 1) + ": expected a key", kSyntaxHint);
        while (p < text.size() && (text[p] == ' ' || text[p] == '\t')) ++p;
        if (p >= text.size() || text[p] != '=')
            fail(kExitBadInput, at(path, line, static_cast<int>(p) + 1) + ": expected '=' after key '" +
                                    key + "'", kSyntaxHint);
        ++p;
        while (p < text.size() && (text[p] == ' ' || text[p] == '\t')) ++p;
        ManifestValue v = parse_value(path, line, text, p);
        while (p < text.size() && (text[p] == ' ' || text[p] == '\t')) ++p;
        if (p < text.size() && text[p] != '#')
            fail(kExitBadInput, at(path, line, static_cast<int>(p) + 1) +
                                    ": unexpected text after the value of '" + key + "'", kSyntaxHint);
        if (m.values.count(key))
            fail(kExitBadInput, at(path, line, static_cast<int>(kb) + 1) + ": duplicate key '" + key +
                                    "' (first on line " + std::to_string(m.key_lines[key]) + ")");
        m.values[key] = v;
        m.key_lines[key] = line;
    }
    return m;
}

std::string toml_float(double v) {
    if (std::isnan(v)) return "nan";
    if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    // Prefer the shortest form that reads back to the same double.
    for (int prec = 9; prec < 17; ++prec) {
        char s[40];
        std::snprintf(s, sizeof s, "%.*g", prec, v);
        if (std::strtod(s, nullptr) == v) { std::snprintf(buf, sizeof buf, "%s", s); break; }
    }
    std::string out = buf;
    if (out.find_first_of(".eE") == std::string::npos) out += ".0";  // else TOML reads an integer
    return out;
}

void ManifestWriter::add(const std::string& key, long long v) {
    out_ += key + " = " + std::to_string(v) + "\n";
}

void ManifestWriter::add_float(const std::string& key, double v) {
    out_ += key + " = " + toml_float(v) + "\n";
}

void ManifestWriter::add_bool(const std::string& key, bool v) {
    out_ += key + " = " + (v ? "true" : "false") + "\n";
}

void ManifestWriter::add(const std::string& key, const std::string& v) {
    std::string q = "\"";
    for (char c : v) {
        unsigned char u = static_cast<unsigned char>(c);
        if (c == '"' || c == '\\') { q += '\\'; q += c; }
        else if (c == '\n') q += "\\n";
        else if (c == '\t') q += "\\t";
        else if (u < 0x20 || u == 0x7F) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", u);
            q += buf;
        } else q += c;
    }
    out_ += key + " = " + q + "\"\n";
}

}  // namespace attnstep
