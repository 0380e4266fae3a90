// matrix_io.cpp — the text and .npy matrix formats; see matrix_io.h and docs/contract.md.
#include "matrix_io.h"

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
#include "atomic_file.h"

namespace attnstep {

bool parse_format(const std::string& s, Format* out) {
    if (s == "txt") { *out = Format::txt; return true; }
    if (s == "npy") { *out = Format::npy; return true; }
    return false;
}

namespace {

const char* kNonfiniteHint = "inputs must be finite; pass --allow-nonfinite to read NaN/Inf on purpose";

std::string read_whole_file(const std::string& path) {
    FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) fail(kExitBadInput, path + ": cannot open: " + std::strerror(errno),
                 "check that the input case holds this file");
    std::string data;
    char buf[1 << 16];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) data.append(buf, n);
    bool bad = std::ferror(f);
    std::fclose(f);
    if (bad) fail(kExitBadInput, path + ": read error: " + std::strerror(errno));
    return data;
}

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
    if (data_rows == 0)
        fail(kExitBadInput, path + ":1:1: empty file (no matrix rows)",
             "regenerate the case; every input file holds one matrix");
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
    std::string text = read_whole_file(path);
    std::string expect = std::to_string(rows) + " x " + std::to_string(cols) + " (" + what + ")";
    TextExtent ext = for_each_text_row(path, text, [&](int line, int row, const std::vector<Token>& tok) {
        if (row >= rows)
            fail(kExitBadInput, at(path, line, 1) + ": extra row " + std::to_string(row + 1) +
                                    "; expected " + expect,
                 "the file holds more rows than the case's dimensions say");
        if (static_cast<int>(tok.size()) < cols) {
            const Token& last = tok.back();
            fail(kExitBadInput, at(path, line, last.col + static_cast<int>(last.len)) + ": row " +
                                    std::to_string(row + 1) + " has " + std::to_string(tok.size()) +
                                    " values; expected " + expect,
                 "every row needs the same number of values");
        }
        if (static_cast<int>(tok.size()) > cols)
            fail(kExitBadInput, at(path, line, tok[cols].col) + ": row " + std::to_string(row + 1) +
                                    " has " + std::to_string(tok.size()) + " values; expected " + expect,
                 "every row needs the same number of values");
        float* out = dst + static_cast<size_t>(row) * cols;
        for (int c = 0; c < cols; ++c) out[c] = parse_value(path, line, tok[c], allow_nonfinite);
    });
    if (ext.data_rows < rows)
        fail(kExitBadInput, at(path, ext.lines + 1, 1) + ": file ends after " +
                                std::to_string(ext.data_rows) + " rows; expected " + expect,
             "the file is truncated or the case's dimensions are wrong");
}

MatrixShape probe_text(const std::string& path) {
    std::string text = read_whole_file(path);
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
};

// Finds `'key':` in the header dict and returns the position just after it.
size_t npy_find_key(const std::string& path, const std::string& dict, const char* key) {
    std::string pat = std::string("'") + key + "':";
    size_t p = dict.find(pat);
    if (p == std::string::npos)
        fail(kExitBadInput, path + ": npy header has no '" + key + "' entry",
             "write the file with np.save");
    p += pat.size();
    while (p < dict.size() && dict[p] == ' ') ++p;
    return p;
}

NpyHeader parse_npy_header(const std::string& path, const std::string& head, size_t file_size) {
    const char* hint = "write the file with np.save(path, a.astype(np.float32)) (a 2-D array)";
    if (head.size() < 10 || head.compare(0, kNpyMagicLen, kNpyMagic, kNpyMagicLen) != 0)
        fail(kExitBadInput, path + ": not a .npy file (bad magic)", hint);
    int major = static_cast<unsigned char>(head[6]);
    size_t len, start;
    if (major == 1) {
        len = static_cast<unsigned char>(head[8]) | (static_cast<unsigned char>(head[9]) << 8);
        start = 10;
    } else if (major == 2 && head.size() >= 12) {
        len = 0;
        for (int i = 3; i >= 0; --i) len = (len << 8) | static_cast<unsigned char>(head[8 + i]);
        start = 12;
    } else {
        fail(kExitBadInput, path + ": unsupported .npy version " + std::to_string(major), hint);
    }
    if (start + len > head.size())
        fail(kExitBadInput, path + ": truncated .npy header", hint);
    std::string dict = head.substr(start, len);

    size_t p = npy_find_key(path, dict, "descr");
    size_t q = dict.find('\'', p + 1);
    std::string descr = (p < dict.size() && dict[p] == '\'' && q != std::string::npos)
                            ? dict.substr(p + 1, q - p - 1) : "?";
    if (descr != "<f4")
        fail(kExitBadInput, path + ": dtype '" + descr + "' is not little-endian float32 ('<f4')", hint);
    p = npy_find_key(path, dict, "fortran_order");
    if (dict.compare(p, 5, "False") != 0)
        fail(kExitBadInput, path + ": fortran_order arrays are not supported", hint);
    p = npy_find_key(path, dict, "shape");
    size_t close = dict.find(')', p);
    if (p >= dict.size() || dict[p] != '(' || close == std::string::npos)
        fail(kExitBadInput, path + ": cannot read the shape in the .npy header", hint);
    std::vector<long long> dims;
    std::string inner = dict.substr(p + 1, close - p - 1);
    const char* s = inner.c_str();
    while (*s) {
        while (*s == ' ' || *s == ',') ++s;
        if (!*s) break;
        char* e = nullptr;
        long long v = std::strtoll(s, &e, 10);
        if (e == s || v < 0 || v > (1 << 30))
            fail(kExitBadInput, path + ": bad shape (" + inner + ") in the .npy header", hint);
        dims.push_back(v);
        s = e;
    }
    if (dims.size() != 2)
        fail(kExitBadInput, path + ": shape (" + inner + ") is not 2-D", hint);
    NpyHeader h;
    h.shape.rows = static_cast<int>(dims[0]);
    h.shape.cols = static_cast<int>(dims[1]);
    h.data_offset = start + len;
    size_t need = static_cast<size_t>(dims[0]) * static_cast<size_t>(dims[1]) * sizeof(float);
    if (file_size != h.data_offset + need)
        fail(kExitBadInput, path + ": holds " + std::to_string(file_size - h.data_offset) +
                                " data bytes; shape (" + inner + ") needs " + std::to_string(need),
             "the file is truncated or damaged; regenerate it");
    return h;
}

long file_size_of(FILE* f) {
    std::fseek(f, 0, SEEK_END);
    long n = std::ftell(f);
    std::fseek(f, 0, SEEK_SET);
    return n;
}

NpyHeader open_npy(const std::string& path, FILE** fp) {
    FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) fail(kExitBadInput, path + ": cannot open: " + std::strerror(errno),
                 "check that the input case holds this file");
    long size = file_size_of(f);
    if (size == 0) { std::fclose(f); fail(kExitBadInput, path + ": empty file", "regenerate the case"); }
    std::string head(static_cast<size_t>(std::min<long>(size, 65536 + 12)), '\0');
    size_t got = std::fread(&head[0], 1, head.size(), f);
    head.resize(got);
    try {
        NpyHeader h = parse_npy_header(path, head, static_cast<size_t>(size));
        std::fseek(f, static_cast<long>(h.data_offset), SEEK_SET);
        *fp = f;
        return h;
    } catch (...) {
        std::fclose(f);
        throw;
    }
}

void read_npy(const std::string& path, int rows, int cols, bool allow_nonfinite,
              const std::string& what, float* dst) {
    FILE* f = nullptr;
    NpyHeader h = open_npy(path, &f);
    if (h.shape.rows != rows || h.shape.cols != cols) {
        std::fclose(f);
        fail(kExitBadInput, path + ": shape (" + std::to_string(h.shape.rows) + ", " +
                                std::to_string(h.shape.cols) + "); expected " + std::to_string(rows) +
                                " x " + std::to_string(cols) + " (" + what + ")",
             "the case's files disagree in shape; regenerate the case");
    }
    size_t n = static_cast<size_t>(rows) * cols;
    size_t got = std::fread(dst, sizeof(float), n, f);
    std::fclose(f);
    if (got != n) fail(kExitBadInput, path + ": short read", "the file is truncated; regenerate it");
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
    FILE* f = nullptr;
    NpyHeader h = open_npy(path, &f);
    std::fclose(f);
    return h.shape;
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
