// matrix_io.h — strict reading and exact writing of one row-major float32 matrix per file, in the
// two formats of docs/contract.md: text (.txt, one row per line, %.9g) and NumPy .npy v1.0 '<f4'.
// Every reading error is an attnstep::Error (exit 2) naming file:line:col (text) or file and
// element (npy), with a HINT on how to fix the input.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "../sequences.h"

namespace attnstep {

class AtomicFile;

enum class Format { txt, npy };
inline const char* format_name(Format f) { return f == Format::npy ? "npy" : "txt"; }
// "txt"/"npy" -> Format; false for anything else.
bool parse_format(const std::string& s, Format* out);

struct MatrixShape {
    int rows = 0, cols = 0;
};

// The shape a file holds, without reading (npy) or converting (txt) its values: for text the
// number of data rows and the number of values on the first row (the strict read checks the rest).
MatrixShape probe_matrix_shape(const std::string& path, Format fmt);

// Fails (exit 2) when a text file of `size` bytes cannot hold a rows x cols matrix (the bounds in
// stages.h): checked before anything is allocated for or read from the file. (An .npy's header
// is read first and its size must then be exact.)
void check_text_file_size(const std::string& path, uint64_t size, int rows, int cols, const std::string& what);

// Reads exactly rows x cols values into dst (row-major). `what` names the expected shape's origin
// for error messages, e.g. "seq_q x d_k from the manifest".
void read_matrix(const std::string& path, Format fmt, int rows, int cols, bool allow_nonfinite,
                 const std::string& what, float* dst);

// A column of counts of tokens, one per row (the packed sequences' offsets and lengths,
// sequences.h): text one decimal integer per line (an optional sign and digits: no point, no
// exponent); .npy one column (R, 1) of any little-endian integer dtype, or float32 holding whole
// numbers; every value 0..kMaxTokens. Errors (exit 2) in the Python reader's words
// (verify/files/sequence_files.py) name file:line:col (text) or file:row r, col 0 (npy, 0-based).
struct IntegerColumn {
    std::vector<long long> values;  // row-major
    int rows = 0, cols = 1;
};
IntegerColumn read_integer_column(const std::string& path, Format fmt);
// A matrix of whole numbers (a paged case's block_table): as a column, but any number of columns,
// every row as many as the first (text: "missing values" or "extra values"; .npy: a 2-D shape),
// every value in `range`.
IntegerColumn read_integer_matrix(const std::string& path, Format fmt, const WholeRange& range);

// Writes rows x cols values; text files start with `header` (one '#' comment line, no newline).
void write_matrix(AtomicFile& out, Format fmt, const float* src, int rows, int cols,
                  const std::string& header);

}  // namespace attnstep
