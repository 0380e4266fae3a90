// npy_format.cpp — the NumPy .npy v1.0 matrix format of docs/contract.md: a 2-D '<f4' array
// (read also '<f2'), its header parsed strictly and its size checked before any value is read.
#include "matrix_formats.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../common.h"
#include "../sequences.h"
#include "../stages.h"
#include "atomic_file.h"
#include "input_file.h"

namespace attnstep {

namespace {

const char kNpyMagic[] = "\x93NUMPY";
constexpr size_t kNpyMagicLen = 6;

struct NpyHeader {
    MatrixShape shape;
    size_t data_offset = 0;
    bool half = false;  // '<f2' (IEEE binary16): an fp16 input, every value exact in float32
    std::string descr;
    size_t item = sizeof(float);  // bytes per value
};

// The dtypes of an integer file (the packed sequences' offsets, sequences.h): every integer dtype
// NumPy writes, little-endian, and float32 holding integers.
struct IntegerDtype {
    const char* descr;
    size_t item;
    bool is_signed;
};
const IntegerDtype kIntegerDtypes[] = {{"|i1", 1, true}, {"|u1", 1, false}, {"<i2", 2, true}, {"<u2", 2, false},
                                       {"<i4", 4, true}, {"<u4", 4, false}, {"<i8", 8, true}, {"<u8", 8, false}};
const IntegerDtype* integer_dtype(const std::string& descr) {
    for (const IntegerDtype& t : kIntegerDtypes)
        if (descr == t.descr) return &t;
    return nullptr;
}
const char* kIntegerNpyHint = "save with arr.astype(np.int32)";

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
// integers: the file holds integers (kIntegerDtypes or '<f4'), not a float matrix; column: one
// column of them (else a matrix of them).
NpyHeader parse_npy_header(const std::string& path, const std::string& head, uint64_t file_size, bool integers,
                           bool column = true) {
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
    const char* hint = integers ? "save np.ascontiguousarray(arr)" : kNpyHint;
    // A sequence file in the Python reader's words (verify/files/sequence_files.py _npy_counts).
    if (integers && descr != "<f4" && !integer_dtype(descr))
        fail(kExitBadInput, path + ": dtype '" + descr + "', expected an integer type or float32 holding whole numbers",
             kIntegerNpyHint);
    if (!integers && descr != "<f4" && descr != "<f2")
        fail(kExitBadInput, path + ": dtype '" + descr + "' is not little-endian float32 ('<f4') or float16 ('<f2')",
             kNpyHint);
    if (fortran_order) fail(kExitBadInput, path + ": fortran_order arrays are not supported", hint);
    if (integers && (dims.size() != 2 || (column && dims[1] != 1))) {  // as Python writes the tuple: (), (4,), (4, 2)
        std::string shape;
        for (size_t i = 0; i < dims.size(); ++i) shape += (i ? ", " : "") + std::to_string(dims[i]);
        fail(kExitBadInput, path + ": shape (" + shape + (dims.size() == 1 ? "," : "") + "), expected " +
                                (column ? "a column (rows, 1)" : "a matrix (rows, columns)"),
             column ? "save arr.reshape(-1, 1)" : "save a 2-D array");
    }
    if (dims.size() != 2) {
        std::string shape;
        for (long long v : dims) shape += std::to_string(v) + ", ";
        fail(kExitBadInput, path + ": shape (" + shape.substr(0, shape.size() - (dims.size() > 1 ? 2 : 1)) + ") is not 2-D",
             hint);
    }
    if (dims[0] > kMaxDim || dims[1] > kMaxDim)
        fail(kExitBadInput, path + ": shape (" + std::to_string(dims[0]) + ", " + std::to_string(dims[1]) +
                                ") exceeds " + std::to_string(kMaxDim) + " in a dimension", hint);
    NpyHeader h;
    h.shape.rows = static_cast<int>(dims[0]);
    h.shape.cols = static_cast<int>(dims[1]);
    h.data_offset = start + len;
    h.half = descr == "<f2";
    h.descr = descr;
    h.item = integer_dtype(descr) ? integer_dtype(descr)->item : h.half ? 2 : sizeof(float);
    const uint64_t need = static_cast<uint64_t>(dims[0]) * static_cast<uint64_t>(dims[1]) * h.item;
    if (file_size != h.data_offset + need)
        fail(kExitBadInput, path + ": holds " + plural(static_cast<long long>(file_size - h.data_offset), "data byte") + "; shape (" +
                                std::to_string(dims[0]) + ", " + std::to_string(dims[1]) + ") needs " + std::to_string(need),
             "the file is truncated or damaged; regenerate it");
    return h;
}

NpyHeader read_npy_header(InputFile& in, bool integers = false, bool column = true) {
    if (in.size() == 0) fail(kExitBadInput, in.path() + ": empty file", "regenerate the case");
    std::string head(static_cast<size_t>(std::min<uint64_t>(in.size(), 12 + kNpyMaxHeaderBytes)), '\0');
    head.resize(std::fread(&head[0], 1, head.size(), in.get()));
    NpyHeader h = parse_npy_header(in.path(), head, in.size(), integers, column);
    if (std::fseek(in.get(), static_cast<long>(h.data_offset), SEEK_SET) != 0)
        fail(kExitBadInput, in.path() + ": cannot seek to the data: " + std::strerror(errno));
    return h;
}

}  // namespace

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
            fail(kExitBadInput, path + ":row " + std::to_string(i / cols) + ", col " +  // NumPy's [row, col]
                                    std::to_string(i % cols) + ": non-finite value " +
                                    (std::isnan(dst[i]) ? "nan" : dst[i] > 0 ? "inf" : "-inf"),
                 kNonfiniteHint);
}

IntegerColumn read_npy_integers(const std::string& path, bool column, const WholeRange& range) {
    InputFile in(path);
    const NpyHeader h = read_npy_header(in, true, column);  // its shape is checked there
    const size_t n = static_cast<size_t>(h.shape.rows) * static_cast<size_t>(h.shape.cols);
    std::vector<unsigned char> raw(n * h.item);
    if (std::fread(raw.data(), 1, raw.size(), in.get()) != raw.size())
        fail(kExitBadInput, path + ": short read", "the file is truncated; regenerate it");
    IntegerColumn out;
    out.values.resize(n);
    const IntegerDtype* t = integer_dtype(h.descr);
    for (size_t i = 0; i < n; ++i) {
        const unsigned char* p = raw.data() + i * h.item;
        std::string problem;
        long long value = 0;
        if (!t) {  // float32: a whole number only
            float f;
            std::memcpy(&f, p, sizeof f);
            problem = count_problem_float(f, &value, range);
        } else {
            uint64_t u = 0;
            for (size_t k = h.item; k-- > 0;) u = (u << 8) | p[k];  // little-endian
            if (t->is_signed) {
                const int bits = static_cast<int>(8 * h.item);
                value = bits == 64 ? static_cast<int64_t>(u) : static_cast<int64_t>(u << (64 - bits)) >> (64 - bits);
                problem = count_problem(value, range);
            } else {
                problem = count_problem_unsigned(u, range);
                value = static_cast<long long>(u);
            }
        }
        if (!problem.empty())
            fail(kExitBadInput, path + ":row " + std::to_string(i / h.shape.cols) + ", col " +
                                    std::to_string(i % h.shape.cols) + ": " + problem);
        out.values[i] = value;
    }
    out.rows = h.shape.rows;
    out.cols = h.shape.cols;
    return out;
}

MatrixShape probe_npy(const std::string& path) {
    InputFile in(path);
    return read_npy_header(in).shape;
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

}  // namespace attnstep
