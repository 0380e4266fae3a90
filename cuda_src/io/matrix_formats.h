// matrix_formats.h — the two matrix formats' readers and writers, which matrix_io.cpp's
// read_matrix, write_matrix and probe_matrix_shape call: text (text_format.cpp) and .npy
// (npy_format.cpp). Arguments and errors as in matrix_io.h.
#pragma once

#include <string>

#include "atomic_file.h"
#include "matrix_io.h"

namespace attnstep {

inline constexpr const char* kNonfiniteHint =
    "inputs must be finite; pass --allow-nonfinite to read NaN/Inf on purpose";

void read_text(const std::string& path, int rows, int cols, bool allow_nonfinite, const std::string& what,
               float* dst);
MatrixShape probe_text(const std::string& path);
void write_text(AtomicFile& out, const float* src, int rows, int cols, const std::string& header);

// column: one value a row (else a matrix); every value in range.
IntegerColumn read_text_integers(const std::string& path, bool column = true, const WholeRange& range = kCountRange);
IntegerColumn read_npy_integers(const std::string& path, bool column = true, const WholeRange& range = kCountRange);

void read_npy(const std::string& path, int rows, int cols, bool allow_nonfinite, const std::string& what,
              float* dst);
MatrixShape probe_npy(const std::string& path);
void write_npy(AtomicFile& out, const float* src, int rows, int cols);

}  // namespace attnstep
