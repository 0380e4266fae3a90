// input_file.cpp — regular-file-only reading; see input_file.h.
#include "input_file.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../common.h"

namespace attnstep {

namespace {

const char* kRegularHint = "only regular files are read (a symlink to one is fine)";

const char* kind_of(mode_t mode) {
    if (S_ISDIR(mode)) return "a folder";
    if (S_ISFIFO(mode)) return "a FIFO";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    if (S_ISSOCK(mode)) return "a socket";
    return "a special file";
}

[[noreturn]] void fail_not_regular(const std::string& path, mode_t mode) {
    fail(kExitBadInput, path + ": is " + kind_of(mode) + ", not a regular file", kRegularHint);
}

[[noreturn]] void fail_cannot_open(const std::string& path, int err) {
    fail(kExitBadInput, path + ": cannot open: " + std::strerror(err), "check that the input case holds this file");
}

}  // namespace

uint64_t regular_file_size(const std::string& path) {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) fail_cannot_open(path, errno);
    if (!S_ISREG(st.st_mode)) fail_not_regular(path, st.st_mode);
    return static_cast<uint64_t>(st.st_size);
}

InputFile::InputFile(const std::string& path) : path_(path) {
    // O_NONBLOCK: opening a FIFO for reading must not wait for a writer; fstat then refuses it.
    int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
        int err = errno;
        struct stat st;
        if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) fail_not_regular(path, st.st_mode);
        fail_cannot_open(path, err);
    }
    struct stat st;
    if (::fstat(fd, &st) != 0) {
        int err = errno;
        ::close(fd);
        fail_cannot_open(path, err);
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd);
        fail_not_regular(path, st.st_mode);
    }
    size_ = static_cast<uint64_t>(st.st_size);
    f_ = ::fdopen(fd, "rb");
    if (!f_) {
        int err = errno;
        ::close(fd);
        fail_cannot_open(path, err);
    }
}

InputFile::~InputFile() {
    if (f_) std::fclose(f_);
}

std::string InputFile::read_all() {
    std::string data(static_cast<size_t>(size_), '\0');
    size_t got = size_ ? std::fread(&data[0], 1, data.size(), f_) : 0;
    if (std::ferror(f_)) fail(kExitBadInput, path_ + ": read error: " + std::strerror(errno));
    if (got != data.size() || std::fgetc(f_) != EOF)
        fail(kExitBadInput, path_ + ": changed size while being read",
             "do not modify the input case while the binary runs");
    return data;
}

}  // namespace attnstep
