// manifest.cpp — reading and writing the flat TOML subset; see manifest.h.
#include "manifest.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "../common.h"
#include "input_file.h"

namespace attnstep {

namespace {

const char* kSyntaxHint =
    "manifest lines are `key = value` in TOML: integers, floats, true/false, \"strings\"";

std::string at(const std::string& path, int line, int col) {
    return path + ":" + std::to_string(line) + ":" + std::to_string(col);
}

bool is_key_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-'; }
bool in_set(char c, const char* set) { return c != '\0' && std::strchr(set, c) != nullptr; }

const char* kDec = "0123456789";

// One line of the manifest, read left to right; every error names path:line:col.
class LineReader {
public:
    LineReader(const std::string& path, int line, const std::string& text) : path_(path), line_(line), t_(text) {}

    [[noreturn]] void error(size_t col0, const std::string& what, const char* hint = kSyntaxHint) const {
        fail(kExitBadInput, at(path_, line_, static_cast<int>(col0) + 1) + ": " + what, hint);
    }
    void skip_space() {
        while (p_ < t_.size() && (t_[p_] == ' ' || t_[p_] == '\t')) ++p_;
    }
    bool done() const { return p_ >= t_.size(); }
    char peek() const { return done() ? '\0' : t_[p_]; }
    size_t pos() const { return p_; }
    void advance() { ++p_; }

    // A bare key or a quoted one (TOML allows both).
    std::string key() {
        if (peek() == '"' || peek() == '\'') return quoted();
        size_t b = p_;
        while (!done() && is_key_char(t_[p_])) ++p_;
        if (p_ == b) error(b, "expected a key");
        return t_.substr(b, p_ - b);
    }

    // The value of `key` (named in errors).
    ManifestValue value(const std::string& key) {
        ManifestValue v;
        v.line = line_;
        v.col = static_cast<int>(p_) + 1;
        if (done()) error(p_, "missing value");
        if (peek() == '"' || peek() == '\'') {
            v.kind = ManifestValue::String;
            v.s = quoted();
            return v;
        }
        size_t b = p_;
        while (!done() && t_[p_] != ' ' && t_[p_] != '\t' && t_[p_] != '#') ++p_;
        std::string tok = t_.substr(b, p_ - b);
        if (tok.empty()) error(b, "missing value");
        if (tok == "true" || tok == "false") {
            v.kind = ManifestValue::Bool;
            v.b = tok == "true";
            return v;
        }
        number(key, tok, b, &v);
        return v;
    }

private:
    // A single-line basic ("...", with TOML's escapes) or literal ('...', none) string.
    std::string quoted() {
        const char q = t_[p_];
        const size_t b = p_;
        if (t_.compare(p_, 3, std::string(3, q)) == 0) error(b, "multi-line strings are not supported");
        ++p_;
        std::string out;
        while (!done() && t_[p_] != q) {
            char c = t_[p_++];
            if (c == '\\' && q == '"') escape(&out);
            else out += c;
        }
        if (done()) error(b, "unterminated string");
        ++p_;
        return out;
    }

    void escape(std::string* out) {
        const size_t b = p_ - 1;
        const char e = peek();
        ++p_;
        switch (e) {
            case 'b': *out += '\b'; return;
            case 't': *out += '\t'; return;
            case 'n': *out += '\n'; return;
            case 'f': *out += '\f'; return;
            case 'r': *out += '\r'; return;
            case '"': *out += '"'; return;
            case '\\': *out += '\\'; return;
            case 'u': case 'U': break;
            default: error(b, "unsupported escape '\\" + std::string(1, e) + "'");
        }
        const size_t n = e == 'u' ? 4 : 8;
        if (p_ + n > t_.size() || !std::all_of(t_.begin() + p_, t_.begin() + p_ + n,
                                               [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); }))
            error(b, std::string("\\") + e + " needs " + std::to_string(n) + " hex digits");
        const unsigned long cp = std::stoul(t_.substr(p_, n), nullptr, 16);
        p_ += n;
        if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) error(b, "escape is not a Unicode scalar value");
        append_utf8(out, static_cast<uint32_t>(cp));
    }

    // TOML numbers exactly as tomllib reads them: decimal integers without leading zeros, 0x/0o/0b
    // integers, floats with digits on both sides of the point, single underscores between digits,
    // inf and nan with an optional sign. Integers must fit 64 bits.
    void number(const std::string& key, const std::string& tok, size_t b, ManifestValue* v) {
        const std::string bad = "cannot read value '" + tok + "'";
        size_t p = (tok[0] == '+' || tok[0] == '-') ? 1 : 0;
        const std::string body = tok.substr(p);
        if (body == "inf" || body == "nan") {
            v->kind = ManifestValue::Float;
            v->f = std::strtod(tok.c_str(), nullptr);
            return;
        }
        static const struct { const char* prefix; const char* digits; int base; } kPrefixed[] = {
            {"0x", "0123456789abcdefABCDEF", 16}, {"0o", "01234567", 8}, {"0b", "01", 2}};
        for (const auto& pr : kPrefixed)
            if (tok.compare(0, 2, pr.prefix) == 0) {
                if (tok.size() == 2 || digits_end(tok, 2, pr.digits) != tok.size()) error(b, bad);
                set_int(key, tok, 2, pr.base, b, v);
                return;
            }
        size_t q = tok.compare(p, 1, "0") == 0 ? p + 1 : digits_end(tok, p, kDec);
        if (q == p) error(b, bad);
        if (q < tok.size() && (in_set(tok[q], kDec) || tok[q] == '_'))
            error(b, bad + ": leading zeros are not allowed");
        if (q == tok.size()) {
            set_int(key, tok, 0, 10, b, v);
            return;
        }
        if (tok[q] == '.') {
            size_t r = digits_end(tok, q + 1, kDec);
            if (r == q + 1) error(b, bad + ": a point needs digits on both sides");
            q = r;
        }
        if (q < tok.size() && (tok[q] == 'e' || tok[q] == 'E')) {
            size_t e = q + 1 + ((q + 1 < tok.size() && (tok[q + 1] == '+' || tok[q + 1] == '-')) ? 1 : 0);
            size_t r = digits_end(tok, e, kDec);
            if (r == e) error(b, bad);
            q = r;
        }
        if (q != tok.size()) error(b, bad);
        v->kind = ManifestValue::Float;
        v->f = std::strtod(without_underscores(tok).c_str(), nullptr);  // out of range: +-inf or 0, as tomllib
    }

    // The end of a run of `set` digits from p, with single underscores between digits.
    static size_t digits_end(const std::string& t, size_t p, const char* set) {
        size_t q = p;
        while (q < t.size() && in_set(t[q], set)) {
            ++q;
            if (q + 1 < t.size() && t[q] == '_' && in_set(t[q + 1], set)) ++q;
        }
        return q;
    }

    static std::string without_underscores(std::string s) {
        s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
        return s;
    }

    // tok[from..] in `base` (64-bit, else an error as in the verifier).
    void set_int(const std::string& key, const std::string& tok, size_t from, int base, size_t b, ManifestValue* v) {
        const std::string clean = without_underscores(tok.substr(from));
        errno = 0;
        const long long i = std::strtoll(clean.c_str(), nullptr, base);
        if (errno == ERANGE)
            error(b, "'" + key + "' = " + tok + ": integer is out of the 64-bit range",
                  "write a float (e.g. 1e20) where a number is meant");
        v->kind = ManifestValue::Int;
        v->i = i;
        v->f = static_cast<double>(i);
    }

    static void append_utf8(std::string* out, uint32_t cp) {
        if (cp < 0x80) { *out += static_cast<char>(cp); return; }
        if (cp < 0x800) {
            *out += static_cast<char>(0xC0 | (cp >> 6));
        } else if (cp < 0x10000) {
            *out += static_cast<char>(0xE0 | (cp >> 12));
            *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        } else {
            *out += static_cast<char>(0xF0 | (cp >> 18));
            *out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
            *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        }
        *out += static_cast<char>(0x80 | (cp & 0x3F));
    }

    const std::string& path_;
    int line_;
    const std::string& t_;
    size_t p_ = 0;
};

// The manifest is ASCII without control characters (tabs aside, and a CR only before a line
// feed), comments included: the verifier's TOML reader refuses them, and the two readers must
// agree on what is valid.
void check_ascii(const std::string& path, int line, const std::string& text) {
    for (size_t i = 0; i < text.size(); ++i) {
        unsigned char c = static_cast<unsigned char>(text[i]);
        if ((c < 0x20 && c != '\t') || c >= 0x7F) {
            char code[8];
            std::snprintf(code, sizeof code, "0x%02X", c);
            fail(kExitBadInput, at(path, line, static_cast<int>(i) + 1) + ": byte " + code +
                                    " in the manifest (ASCII text only)", kSyntaxHint);
        }
    }
}

}  // namespace

std::string Manifest::where(const std::string& key) const {
    const ManifestValue* v = find(key);
    return v ? at(path, v->line, v->col) : path;
}

Manifest read_manifest(const std::string& path) {
    const std::string data = InputFile(path).read_all();
    Manifest m;
    m.path = path;
    int line = 0;
    for (size_t start = 0; start < data.size();) {
        size_t nl = data.find('\n', start);
        std::string text = data.substr(start, nl == std::string::npos ? std::string::npos : nl - start);
        start = nl == std::string::npos ? data.size() : nl + 1;
        ++line;
        if (nl != std::string::npos && !text.empty() && text.back() == '\r') text.pop_back();
        check_ascii(path, line, text);
        LineReader r(path, line, text);
        r.skip_space();
        if (r.done() || r.peek() == '#') continue;
        if (r.peek() == '[') r.error(r.pos(), "tables are not supported in the manifest");
        const size_t kb = r.pos();
        std::string key = r.key();
        r.skip_space();
        if (r.peek() == '.') r.error(r.pos(), "dotted keys are not supported in the manifest");
        if (r.peek() != '=') r.error(r.pos(), "expected '=' after key '" + key + "'");
        r.advance();
        r.skip_space();
        ManifestValue v = r.value(key);
        r.skip_space();
        if (!r.done() && r.peek() != '#') r.error(r.pos(), "unexpected text after the value of '" + key + "'");
        if (m.values.count(key))
            r.error(kb, "duplicate key '" + key + "' (first on line " + std::to_string(m.key_lines[key]) + ")", "");
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

namespace {

// The code point of the UTF-8 sequence at s[i] (advancing i), or U+FFFD for a byte that does not
// start a valid sequence (a path need not be UTF-8; TOML strings must be).
uint32_t next_code_point(const std::string& s, size_t& i) {
    const unsigned char c = static_cast<unsigned char>(s[i++]);
    if (c < 0x80) return c;
    const int extra = c >= 0xF0 && c <= 0xF4 ? 3 : c >= 0xE0 && c < 0xF0 ? 2 : c >= 0xC2 && c < 0xE0 ? 1 : -1;
    if (extra < 0 || i + extra > s.size()) return 0xFFFD;
    uint32_t cp = c & (0x3F >> extra);
    for (int k = 0; k < extra; ++k) {
        const unsigned char cc = static_cast<unsigned char>(s[i + k]);
        if ((cc & 0xC0) != 0x80) return 0xFFFD;
        cp = (cp << 6) | (cc & 0x3F);
    }
    static const uint32_t kLeast[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kLeast[extra] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0xFFFD;
    i += extra;
    return cp;
}

}  // namespace

// A TOML basic string in ASCII: non-ASCII characters and control characters as \u/\U escapes, which
// tomllib decodes back (the verifier reads manifests as ASCII only).
std::string toml_string(const std::string& v) {
    std::string q = "\"";
    for (size_t i = 0; i < v.size();) {
        const uint32_t cp = next_code_point(v, i);
        char buf[16];
        if (cp == '"' || cp == '\\') { q += '\\'; q += static_cast<char>(cp); }
        else if (cp == '\n') q += "\\n";
        else if (cp == '\t') q += "\\t";
        else if (cp >= 0x20 && cp < 0x7F) q += static_cast<char>(cp);
        else {
            std::snprintf(buf, sizeof buf, cp > 0xFFFF ? "\\U%08X" : "\\u%04X", static_cast<unsigned>(cp));
            q += buf;
        }
    }
    return q + "\"";
}

void ManifestWriter::add(const std::string& key, const std::string& v) {
    out_ += key + " = " + toml_string(v) + "\n";
}

}  // namespace attnstep
