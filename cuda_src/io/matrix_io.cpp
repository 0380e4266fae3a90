// matrix_io.cpp — one matrix per file in either format (matrix_io.h): each call goes to the
// format's reader or writer (text_format.cpp, npy_format.cpp).
#include "matrix_io.h"

#include "matrix_formats.h"

namespace attnstep {

bool parse_format(const std::string& s, Format* out) {
    if (s == "txt") { *out = Format::txt; return true; }
    if (s == "npy") { *out = Format::npy; return true; }
    return false;
}

MatrixShape probe_matrix_shape(const std::string& path, Format fmt) {
    return fmt == Format::txt ? probe_text(path) : probe_npy(path);
}

void read_matrix(const std::string& path, Format fmt, int rows, int cols, bool allow_nonfinite,
                 const std::string& what, float* dst) {
    if (fmt == Format::txt) read_text(path, rows, cols, allow_nonfinite, what, dst);
    else read_npy(path, rows, cols, allow_nonfinite, what, dst);
}

IntegerColumn read_integer_column(const std::string& path, Format fmt) {
    return fmt == Format::txt ? read_text_integers(path) : read_npy_integers(path);
}

IntegerColumn read_integer_matrix(const std::string& path, Format fmt, const WholeRange& range) {
    return fmt == Format::txt ? read_text_integers(path, false, range) : read_npy_integers(path, false, range);
}

void write_matrix(AtomicFile& out, Format fmt, const float* src, int rows, int cols,
                  const std::string& header) {
    if (fmt == Format::txt) write_text(out, src, rows, cols, header);
    else write_npy(out, src, rows, cols);
}

}  // namespace attnstep
