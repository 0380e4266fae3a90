// input_file.h — opening a file the binary reads (input matrices, the input manifest): regular
// files only, after following symlinks. A FIFO would block the read forever and a device such as
// /dev/zero never ends, so both are refused before a byte is read, with one line naming the file
// and what it is (verify/files/case.py read_bytes says the same).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace attnstep {

// An open regular file and its size. Fails (exit 2) when the path is missing, unreadable or not
// a regular file.
class InputFile {
public:
    explicit InputFile(const std::string& path);
    ~InputFile();
    InputFile(const InputFile&) = delete;
    InputFile& operator=(const InputFile&) = delete;

    FILE* get() const { return f_; }
    uint64_t size() const { return size_; }
    const std::string& path() const { return path_; }
    // The whole file (at most size() bytes: a file that grows while read is an error).
    std::string read_all();

private:
    std::string path_;
    FILE* f_ = nullptr;
    uint64_t size_ = 0;
};

// The size of a regular file without opening it; the same failures as InputFile.
uint64_t regular_file_size(const std::string& path);

}  // namespace attnstep
