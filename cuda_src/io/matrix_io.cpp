// matrix_io.cpp — the text and .npy matrix formats; see matrix_io.h and docs/contract.md.
#include "matrix_io.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <strings.h>  // strncasecmp
#include <vector>

#include "../common.h"
#include "../stages.h"
#include "atomic_file.h"
#include "input_file.h"

namespace attnstep {

bool parse_format(const std::string& s, Format* out) {
    if (s == "txt") { *out = Format::txt; return true; }
    if (s == "npy") { *out = Format::npy; return true; }
    return false;
}

namespace {

const char* kNonfiniteHint = "inputs must be finite; pass --allow-nonfinite to read NaN/Inf on purpose";

// ---------------------------------------------------------------- text
// Walks a text matrix's data rows: skips '#' comment lines, allows blank lines only at the end,
// and hands each data row's tokens (with their 1-based columns) to a callback.
struct Token {
    const char* begin;
    size_t len;
    int col;  // 1-based character column
};

struct TextExtent {
    int lines = 0, data_rows = 0;
};

[[noreturn]] void fail_empty_text(const std::string& path) {
    fail(kExitBadInput, path + ":1:1: empty file (no matrix rows)", "regenerate the case; every input file holds one matrix");
}

template <typename OnRow>
TextExtent for_each_text_row(const std::string& path, const std::string& text, OnRow on_row) {
    int line_no = 0, data_rows = 0, blank_line = 0;
    std::vector<Token> tokens;
    size_t pos = 0;
    while (pos < text.size()) {
        size_t end = text.find('\n', pos);
        if (end == std::string::npos) end = text.size();
        ++line_no;
        size_t stop = end;
        if (stop > pos && text[stop - 1] == '\r') --stop;  // tolerate CRLF files
        tokens.clear();
        size_t i = pos;
        while (i < stop) {
            while (i < stop && (text[i] == ' ' || text[i] == '\t')) ++i;
            if (i >= stop) break;
            size_t b = i;
            while (i < stop && text[i] != ' ' && text[i] != '\t') ++i;
            tokens.push_back({text.data() + b, i - b, static_cast<int>(b - pos) + 1});
        }
        pos = end + 1;
        if (tokens.empty()) {
            if (!blank_line) blank_line = line_no;
            continue;
        }
        if (tokens[0].begin[0] == '#') continue;
        if (blank_line)
            fail(kExitBadInput, path + ":" + std::to_string(blank_line) +
                                    ":1: blank line inside the matrix (allowed only at the end)",
                 "remove the blank line; every line is one matrix row");
        on_row(line_no, data_rows, tokens);
        ++data_rows;
    }
    if (data_rows == 0) fail_empty_text(path);
    return {line_no, data_rows};
}

std::string at(const std::string& path, int line, int col) {
    return path + ":" + std::to_string(line) + ":" + std::to_string(col);
}

// The number syntax both readers accept (verify/case.py has the same rule): decimal digits, sign,
// point and exponent, or inf/infinity/nan. strtof alone would also take hex floats and "nan(...)",
// which NumPy's reader rejects, and the two sides must agree on what is valid.
bool plain_number_syntax(const char* s, size_t n) {
    static const char* const words[] = {"inf", "infinity", "nan"};
    const char* w = s + ((n > 0 && (s[0] == '+' || s[0] == '-')) ? 1 : 0);
    size_t wn = n - static_cast<size_t>(w - s);
    for (const char* word : words)
        if (wn == std::strlen(word) && strncasecmp(w, word, wn) == 0) return true;
    for (size_t i = 0; i < n; ++i)
        if (!std::strchr("0123456789+-.eE", s[i])) return false;
    return true;
}

float parse_value(const std::string& path, int line, const Token& t, bool allow_nonfinite) {
    // strtof needs a terminated string; tokens are short, but a valid number may have any number
    // of digits, so a long one gets a heap copy rather than an error.
    char small[64];
    std::string big;
    char* buf = small;
    if (t.len >= sizeof small) {
        big.assign(t.begin, t.len);
        buf = &big[0];
    } else {
        std::memcpy(small, t.begin, t.len);
        small[t.len] = '\0';
    }
    char* endp = nullptr;
    errno = 0;
    float v = std::strtof(buf, &endp);
    if (endp != buf + t.len || !plain_number_syntax(buf, t.len))
        fail(kExitBadInput, at(path, line, t.col) + ": not a number: '" + std::string(buf, std::min<size_t>(t.len, 40)) + "'",
             "values are decimal numbers separated by spaces, as np.savetxt writes them");
    if (errno == ERANGE && std::isinf(v))
        fail(kExitBadInput, at(path, line, t.col) + ": value '" + buf + "' overflows float32",
             "inputs are float32; scale the data down");
    if (!allow_nonfinite && !std::isfinite(v))
        fail(kExitBadInput, at(path, line, t.col) + ": non-finite value '" + buf + "'",
             kNonfiniteHint);
    return v;
}

void read_text(const std::string& path, int rows, int cols, bool allow_nonfinite,
               const std::string& what, float* dst) {
    InputFile in(path);
    check_text_file_size(path, in.size(), rows, cols, what);
    std::string text = in.read_all();
    std::string expect = std::to_string(rows) + " x " + std::to_string(cols) + " (" + what + ")";
    TextExtent ext = for_each_text_row(path, text, [&](int line, int row, const std::vector<Token>& tok) {
        if (row >= rows)
            fail(kExitBadInput, at(path, line, 1) + ": extra row " + std::to_string(row + 1) +
                                    "; expected " + expect,
                 "the file holds more rows than the case's dimensions say");
        if (static_cast<int>(tok.size()) < cols) {
            const Token& last = tok.back();
            fail(kExitBadInput, at(path, line, last.col + static_cast<int>(last.len)) + ": row " +
                                    std::to_string(row + 1) + " has " +
                                    plural(static_cast<long long>(tok.size()), "value") + "; expected " + expect,
                 "every row needs the same number of values");
        }
        if (static_cast<int>(tok.size()) > cols)
            fail(kExitBadInput, at(path, line, tok[cols].col) + ": row " + std::to_string(row + 1) +
                                    " has " + plural(static_cast<long long>(tok.size()), "value") + "; expected " +
                                    expect,
                 "every row needs the same number of values");
        float* out = dst + static_cast<size_t>(row) * cols;
        for (int c = 0; c < cols; ++c) out[c] = parse_value(path, line, tok[c], allow_nonfinite);
    });
    if (ext.data_rows < rows)
        fail(kExitBadInput, at(path, ext.lines + 1, 1) + ": file ends after " +
                                plural(ext.data_rows, "row") + "; expected " + expect,
             "the file is truncated or the case's dimensions are wrong");
}

MatrixShape probe_text(const std::string& path) {
    std::string text = InputFile(path).read_all();
    MatrixShape s;
    for_each_text_row(path, text, [&](int, int row, const std::vector<Token>& tok) {
        if (row == 0) s.cols = static_cast<int>(tok.size());
        s.rows = row + 1;
    });
    return s;
}

// %.9g (float32 round-trips exactly); std::to_chars formats as printf would, several times faster.
void write_text_value(std::string& line, float v) {
    if (std::isnan(v)) { line += "nan"; return; }  // never "-nan"
    if (std::isinf(v)) { line += v > 0 ? "inf" : "-inf"; return; }
    char buf[32];
    std::to_chars_result res = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::general, 9);
    line.append(buf, res.ptr);
}

void write_text(AtomicFile& out, const float* src, int rows, int cols, const std::string& header) {
    out.write(header + "\n");
    std::string line;
    for (int r = 0; r < rows; ++r) {
        line.clear();
        const float* row = src + static_cast<size_t>(r) * cols;
        for (int c = 0; c < cols; ++c) {
            if (c) line += ' ';
            write_text_value(line, row[c]);
        }
        line += '\n';
        out.write(line);
    }
}

// ---------------------------------------------------------------- npy
const char kNpyMagic[] = "\x93NUMPY";
constexpr size_t kNpyMagicLen = 6;

struct NpyHeader {
    MatrixShape shape;
    size_t data_offset = 0;
    bool half = false;  // '<f2' (IEEE binary16): an fp16 input, every value exact in float32
};

// An IEEE binary16 value (its bits) as the float32 that equals it: normals and subnormals exactly,
// +-inf and NaN kept.
float half_bits_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const int exp = (h >> 10) & 0x1F;
    const uint32_t mant = h & 0x3FFu;
    float v;
    if (exp == 0x1F) {
        const uint32_t bits = sign | 0x7F800000u | (mant << 13);
        std::memcpy(&v, &bits, sizeof v);
        return v;
    }
    v = exp == 0 ? std::ldexp(static_cast<float>(mant), -24) : std::ldexp(static_cast<float>(mant | 0x400u), exp - 25);
    return sign ? -v : v;
}

const char* kNpyHint = "write the file with np.save(path, a.astype(np.float32)) (a 2-D array)";

// The header dict as np.load reads it (a Python literal): exactly the keys descr, fortran_order and
// shape, quoted with ' or " (no escapes), descr a string, fortran_order True or False, shape a
// tuple of decimal integers. np.load refuses any other key, so this reader does too.
class NpyDictParser {
public:
    NpyDictParser(const std::string& path, const std::string& text) : path_(path), s_(text) {}

    void parse(std::string* descr, bool* fortran_order, std::vector<long long>* shape) {
        expect('{', "at the start of the header");
        bool seen[3] = {false, false, false};
        while (!take('}')) {
            std::string key = quoted();
            expect(':', "after '" + key + "'");
            if (key == "descr") { *descr = quoted(); seen[0] = true; }
            else if (key == "fortran_order") { *fortran_order = boolean(); seen[1] = true; }
            else if (key == "shape") { *shape = tuple(); seen[2] = true; }
            else bad("unexpected key '" + key + "' (np.load reads only descr, fortran_order and shape)");
            if (take('}')) break;
            expect(',', "between the header's entries");
        }
        skip_space();
        if (p_ != s_.size()) bad("text after the header's closing '}'");
        const char* keys[] = {"descr", "fortran_order", "shape"};
        for (int i = 0; i < 3; ++i)
            if (!seen[i]) bad(std::string("no '") + keys[i] + "' entry");
    }

private:
    [[noreturn]] void bad(const std::string& what) const {
        fail(kExitBadInput, path_ + ": .npy header: " + what, kNpyHint);
    }
    void skip_space() {
        while (p_ < s_.size() && (s_[p_] == ' ' || s_[p_] == '\t' || s_[p_] == '\n' || s_[p_] == '\r')) ++p_;
    }
    bool take(char c) {
        skip_space();
        if (p_ < s_.size() && s_[p_] == c) { ++p_; return true; }
        return false;
    }
    void expect(char c, const std::string& where) {
        if (!take(c)) bad(std::string("expected '") + c + "' " + where);
    }
    std::string quoted() {
        skip_space();
        char q = p_ < s_.size() ? s_[p_] : '\0';
        if (q != '\'' && q != '"') bad("expected a quoted string");
        size_t close = s_.find(q, p_ + 1);
        if (close == std::string::npos) bad("unterminated string");
        std::string v = s_.substr(p_ + 1, close - p_ - 1);
        if (v.find_first_of("\\\n") != std::string::npos) bad("escapes in strings are not supported");
        p_ = close + 1;
        return v;
    }
    bool boolean() {
        skip_space();
        for (bool b : {true, false}) {
            const char* word = b ? "True" : "False";
            size_t n = std::strlen(word);
            if (s_.compare(p_, n, word) == 0 && (p_ + n == s_.size() || !std::isalnum(static_cast<unsigned char>(s_[p_ + n])))) {
                p_ += n;
                return b;
            }
        }
        bad("fortran_order is not True or False");
    }
    // A Python int literal: decimal digits with single underscores between them, no leading zeros
    // (but 0, 00, ...).
    long long integer() {
        skip_space();
        size_t b = p_;
        long long v = 0;
        while (p_ < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[p_])) ||
                                  (s_[p_] == '_' && p_ > b && p_ + 1 < s_.size() && s_[p_ - 1] != '_' &&
                                   std::isdigit(static_cast<unsigned char>(s_[p_ + 1]))))) {
            if (s_[p_] != '_') {
                v = v * 10 + (s_[p_] - '0');
                if (v > (1LL << 40)) bad("shape value too large");
            }
            ++p_;
        }
        std::string tok = s_.substr(b, p_ - b);
        if (tok.empty()) bad("shape holds something other than non-negative integers");
        if (tok[0] == '0' && tok.find_first_not_of("0_") != std::string::npos) bad("shape value '" + tok + "' has a leading zero");
        return v;
    }
    // A tuple: (), (a,), (a, b) or (a, b,); `(a)` is an int in Python, not a tuple.
    std::vector<long long> tuple() {
        expect('(', "to open the shape");
        std::vector<long long> v;
        bool trailing_comma = false;
        while (!take(')')) {
            v.push_back(integer());
            trailing_comma = take(',');
            if (!trailing_comma) {
                expect(')', "to close the shape");
                break;
            }
        }
        if (v.size() == 1 && !trailing_comma) bad("shape is not a tuple");
        return v;
    }

    const std::string& path_;
    const std::string& s_;
    size_t p_ = 0;
};

// Versions 1.0 (2-byte header length), 2.0 and 3.0 (4-byte), as np.load reads them.
NpyHeader parse_npy_header(const std::string& path, const std::string& head, uint64_t file_size) {
    if (head.size() < 10 || head.compare(0, kNpyMagicLen, kNpyMagic, kNpyMagicLen) != 0)
        fail(kExitBadInput, path + ": not a .npy file (bad magic)", kNpyHint);
    int major = static_cast<unsigned char>(head[6]), minor = static_cast<unsigned char>(head[7]);
    if (major < 1 || major > 3 || minor != 0)
        fail(kExitBadInput, path + ": unsupported .npy version " + std::to_string(major) + "." + std::to_string(minor),
             kNpyHint);
    size_t len = 0, start = major == 1 ? 10 : 12;
    if (head.size() < start) fail(kExitBadInput, path + ": truncated .npy header", kNpyHint);
    for (size_t i = start; i-- > 8;) len = (len << 8) | static_cast<unsigned char>(head[i]);
    if (static_cast<long long>(len) > kNpyMaxHeaderBytes)
        fail(kExitBadInput, path + ": .npy header of " + std::to_string(len) + " bytes exceeds " +
                                std::to_string(kNpyMaxHeaderBytes), kNpyHint);
    if (start + len > head.size()) fail(kExitBadInput, path + ": truncated .npy header", kNpyHint);
    const std::string dict = head.substr(start, len);
    for (char c : dict)
        if (static_cast<unsigned char>(c) >= 0x80)
            fail(kExitBadInput, path + ": .npy header: non-ASCII byte", kNpyHint);

    std::string descr;
    bool fortran_order = false;
    std::vector<long long> dims;
    NpyDictParser(path, dict).parse(&descr, &fortran_order, &dims);
    if (descr != "<f4" && descr != "<f2")
        fail(kExitBadInput, path + ": dtype '" + descr + "' is not little-endian float32 ('<f4') or float16 ('<f2')",
             kNpyHint);
    if (fortran_order) fail(kExitBadInput, path + ": fortran_order arrays are not supported", kNpyHint);
    if (dims.size() != 2) {
        std::string shape;
        for (long long v : dims) shape += std::to_string(v) + ", ";
        fail(kExitBadInput, path + ": shape (" + shape.substr(0, shape.size() - (dims.size() > 1 ? 2 : 1)) + ") is not 2-D",
             kNpyHint);
    }
    if (dims[0] > kMaxDim || dims[1] > kMaxDim)
        fail(kExitBadInput, path + ": shape (" + std::to_string(dims[0]) + ", " + std::to_string(dims[1]) +
                                ") exceeds " + std::to_string(kMaxDim) + " in a dimension", kNpyHint);
    NpyHeader h;
    h.shape.rows = static_cast<int>(dims[0]);
    h.shape.cols = static_cast<int>(dims[1]);
    h.data_offset = start + len;
    h.half = descr == "<f2";
    const uint64_t need = static_cast<uint64_t>(dims[0]) * static_cast<uint64_t>(dims[1]) * (h.half ? 2 : sizeof(float));
    if (file_size != h.data_offset + need)
        fail(kExitBadInput, path + ": holds " + plural(static_cast<long long>(file_size - h.data_offset), "data byte") + "; shape (" +
                                std::to_string(dims[0]) + ", " + std::to_string(dims[1]) + ") needs " + std::to_string(need),
             "the file is truncated or damaged; regenerate it");
    return h;
}

NpyHeader read_npy_header(InputFile& in) {
    if (in.size() == 0) fail(kExitBadInput, in.path() + ": empty file", "regenerate the case");
    std::string head(static_cast<size_t>(std::min<uint64_t>(in.size(), 12 + kNpyMaxHeaderBytes)), '\0');
    head.resize(std::fread(&head[0], 1, head.size(), in.get()));
    NpyHeader h = parse_npy_header(in.path(), head, in.size());
    if (std::fseek(in.get(), static_cast<long>(h.data_offset), SEEK_SET) != 0)
        fail(kExitBadInput, in.path() + ": cannot seek to the data: " + std::strerror(errno));
    return h;
}

void read_npy(const std::string& path, int rows, int cols, bool allow_nonfinite,
              const std::string& what, float* dst) {
    InputFile in(path);
    NpyHeader h = read_npy_header(in);
    if (h.shape.rows != rows || h.shape.cols != cols)
        fail(kExitBadInput, path + ": shape (" + std::to_string(h.shape.rows) + ", " +
                                std::to_string(h.shape.cols) + "); expected " + std::to_string(rows) +
                                " x " + std::to_string(cols) + " (" + what + ")",
             "the case's files disagree in shape; regenerate the case");
    size_t n = static_cast<size_t>(rows) * cols;
    if (h.half) {
        // Read as 16-bit values into the upper half of dst, then widen front to back: value i
        // lands at i after it was read from byte 2n + 2i, which no earlier value overwrote.
        // (Byte access: a char may alias the floats, so no load moves past an earlier store.)
        unsigned char* raw = reinterpret_cast<unsigned char*>(dst) + 2 * n;
        if (std::fread(raw, 2, n, in.get()) != n)
            fail(kExitBadInput, path + ": short read", "the file is truncated; regenerate it");
        for (size_t i = 0; i < n; ++i) {
            const uint16_t bits = static_cast<uint16_t>(raw[2 * i] | (raw[2 * i + 1] << 8));  // little-endian
            dst[i] = half_bits_to_float(bits);
        }
    } else if (std::fread(dst, sizeof(float), n, in.get()) != n) {
        fail(kExitBadInput, path + ": short read", "the file is truncated; regenerate it");
    }
    if (allow_nonfinite) return;
    for (size_t i = 0; i < n; ++i)
        if (!std::isfinite(dst[i]))
            fail(kExitBadInput, path + ": row " + std::to_string(i / cols + 1) + ", col " +
                                    std::to_string(i % cols + 1) + ": non-finite value " +
                                    (std::isnan(dst[i]) ? "nan" : dst[i] > 0 ? "inf" : "-inf"),
                 kNonfiniteHint);
}

void write_npy(AtomicFile& out, const float* src, int rows, int cols) {
    std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(rows) +
                       ", " + std::to_string(cols) + "), }";
    // Pad with spaces and a final newline so the data starts on a 64-byte boundary, as NumPy does.
    size_t total = 10 + dict.size() + 1;
    dict.append((64 - total % 64) % 64, ' ');
    dict += '\n';
    std::string head(kNpyMagic, kNpyMagicLen);
    head += '\x01';
    head += '\x00';
    head += static_cast<char>(dict.size() & 0xFF);
    head += static_cast<char>((dict.size() >> 8) & 0xFF);
    out.write(head + dict);
    out.write(src, static_cast<size_t>(rows) * cols * sizeof(float));  // host is little-endian
}

}  // namespace

MatrixShape probe_matrix_shape(const std::string& path, Format fmt) {
    if (fmt == Format::txt) return probe_text(path);
    InputFile in(path);
    return read_npy_header(in).shape;
}

void check_text_file_size(const std::string& path, uint64_t size, int rows, int cols, const std::string& what) {
    if (size == 0) fail_empty_text(path);
    const uint64_t values = static_cast<uint64_t>(rows) * static_cast<uint64_t>(cols);
    const std::string shape = std::to_string(rows) + " x " + std::to_string(cols) + " (" + what + ")";
    // At least one character per value, one separator between values, a line end between rows.
    const uint64_t least = 2 * values - 1;
    const uint64_t most = static_cast<uint64_t>(kTextBytesPerValue) * values + static_cast<uint64_t>(kTextSlackBytes);
    if (size < least)
        fail(kExitBadInput, path + ": " + plural(static_cast<long long>(size), "byte") + " cannot hold " + shape +
                                " text values (at least " + plural(static_cast<long long>(least), "byte") + ")",
             "the file is truncated or the case's dimensions are wrong");
    if (size > most)
        fail(kExitBadInput, path + ": " + plural(static_cast<long long>(size), "byte") + " is more than a text matrix of " + shape +
                                " may take (" + std::to_string(most) + " bytes: " + std::to_string(kTextBytesPerValue) +
                                " per value and " + std::to_string(kTextSlackBytes) + " for comments)",
             "the file is not this matrix, or write values with fewer digits (%.9g round-trips float32)");
}

void read_matrix(const std::string& path, Format fmt, int rows, int cols, bool allow_nonfinite,
                 const std::string& what, float* dst) {
    if (fmt == Format::txt) read_text(path, rows, cols, allow_nonfinite, what, dst);
    else read_npy(path, rows, cols, allow_nonfinite, what, dst);
}

void write_matrix(AtomicFile& out, Format fmt, const float* src, int rows, int cols,
                  const std::string& header) {
    if (fmt == Format::txt) write_text(out, src, rows, cols, header);
    else write_npy(out, src, rows, cols);
}

}  // namespace attnstep
