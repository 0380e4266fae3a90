// text_format.cpp — the text matrix format of docs/contract.md: one row per line, values
// separated by spaces, '#' comment lines; read strictly (errors at file:line:col), written %.9g.
#include "matrix_formats.h"

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
#include <system_error>
#include <vector>

#include "../common.h"
#include "../sequences.h"
#include "../stages.h"
#include "atomic_file.h"
#include "input_file.h"

namespace attnstep {

namespace {

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

// The number syntax both readers accept (verify/files/case.py has the same rule): decimal digits, sign,
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



// %.9g (float32 round-trips exactly); std::to_chars formats as printf would, several times faster.
void write_text_value(std::string& line, float v) {
    if (std::isnan(v)) { line += "nan"; return; }  // never "-nan"
    if (std::isinf(v)) { line += v > 0 ? "inf" : "-inf"; return; }
    char buf[32];
    std::to_chars_result res = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::general, 9);
    line.append(buf, res.ptr);
}

}  // namespace

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

// A sequence file (sequences.h) in the Python reader's words (verify/files/sequence_files.py,
// which walks the rows as verify/files/matrix_io.py text_rows does): ASCII only; lines split at
// '\n', each stripped of spaces, tabs and '\r'; '#' comment lines skipped; a blank line before a row
// refused; values separated by spaces, tabs and '\r'; one value a row, a count of tokens.
IntegerColumn read_text_integers(const std::string& path, bool column, const WholeRange& range) {
    InputFile in(path);
    // One count per line: at most 21 characters a value (a sign and 20 digits) and a line end;
    // the slack for comments as a matrix has.
    if (in.size() > kTextSlackBytes + 32ull * static_cast<uint64_t>(kMaxDim) + 32ull)
        fail(kExitBadInput, path + ": " + plural(static_cast<long long>(in.size()), "byte") +
                                " is more than a column of counts may take",
             "the file is not this column of integers");
    const std::string text = in.read_all();
    for (size_t i = 0; i < text.size(); ++i)
        if (static_cast<unsigned char>(text[i]) >= 0x80)
            fail(kExitBadInput, path + ": not a text file (non-ASCII byte at offset " + std::to_string(i) + ")",
                 "is it a .npy file with the wrong extension?");
    auto separator = [](char ch) { return ch == ' ' || ch == '\t' || ch == '\r'; };
    struct Row {
        int line;
        std::vector<int> cols;  // each token's 1-based column
        std::vector<std::string> tokens;
    };
    std::vector<Row> rows;
    int line_no = 0, blank_at = 0;
    for (size_t pos = 0; pos <= text.size();) {
        size_t end = text.find('\n', pos);
        if (end == std::string::npos) end = text.size();
        const std::string line = text.substr(pos, end - pos);
        pos = end + 1;
        ++line_no;
        size_t first = 0, last = line.size();
        while (first < last && separator(line[first])) ++first;
        while (last > first && separator(line[last - 1])) --last;
        if (first < last && line[first] == '#') continue;
        if (first == last) {
            if (!blank_at) blank_at = line_no;
            continue;
        }
        if (blank_at)
            fail(kExitBadInput, path + ":" + std::to_string(blank_at) + ": blank line inside the matrix",
                 "one matrix row per line, no empty lines");
        Row row{line_no, {}, {}};
        for (size_t i = first; i < last;) {
            size_t j = i;
            while (j < last && !separator(line[j])) ++j;
            row.cols.push_back(static_cast<int>(i) + 1);
            row.tokens.push_back(line.substr(i, j - i));
            while (j < last && separator(line[j])) ++j;
            i = j;
        }
        rows.push_back(row);
    }
    if (rows.empty()) fail(kExitBadInput, path + ": empty file: no matrix rows");
    IntegerColumn out;
    const size_t want = column ? 1 : rows.front().tokens.size();
    for (const Row& row : rows) {
        if (row.tokens.size() != want)
            fail(kExitBadInput, path + ":" + std::to_string(row.line) + ": " +
                                    (row.tokens.size() < want ? "missing values: " : "extra values: ") +
                                    plural(static_cast<long long>(row.tokens.size()), "value") + " on this row, expected " +
                                    std::to_string(want),
                 "a ragged or truncated row");
        for (size_t t = 0; t < row.tokens.size(); ++t) {
            long long v = 0;
            const std::string problem = integer_token_problem(row.tokens[t], &v, range);
            if (!problem.empty())
                fail(kExitBadInput, path + ":" + std::to_string(row.line) + ":" + std::to_string(row.cols[t]) + ": " + problem);
            out.values.push_back(v);
        }
    }
    out.rows = static_cast<int>(rows.size());
    out.cols = static_cast<int>(want);
    return out;
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

}  // namespace attnstep
