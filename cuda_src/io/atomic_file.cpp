// atomic_file.cpp — temp-file-and-rename writing; see atomic_file.h.
#include "atomic_file.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <unistd.h>

#include "../common.h"
#include "crc32.h"

namespace attnstep {

namespace {
constexpr size_t kBufferBytes = 1u << 20;

std::string errno_text() { return std::strerror(errno); }
}  // namespace

AtomicFile::AtomicFile(const std::string& final_path, const std::string& run_id)
    : final_path_(final_path), tmp_path_(final_path + ".tmp-" + run_id) {
    f_ = std::fopen(tmp_path_.c_str(), "wb");
    if (!f_)
        fail(kExitBadInput, tmp_path_ + ": cannot create: " + errno_text(),
             "check that the output folder is writable and the disk is not full");
    buf_.reserve(kBufferBytes);
}

AtomicFile::~AtomicFile() {
    if (f_) {
        std::fclose(f_);
        std::remove(tmp_path_.c_str());
    }
}

void AtomicFile::flush_buffer() {
    if (buf_.empty()) return;
    crc_ = crc32_update(crc_, buf_.data(), buf_.size());
    if (std::fwrite(buf_.data(), 1, buf_.size(), f_) != buf_.size())
        fail(kExitInternal, tmp_path_ + ": write failed: " + errno_text(),
             "check free disk space in the output folder");
    buf_.clear();
}

void AtomicFile::write(const void* data, size_t len) {
    const char* p = static_cast<const char*>(data);
    while (len > 0) {
        size_t take = std::min(len, kBufferBytes - buf_.size());
        buf_.insert(buf_.end(), p, p + take);
        p += take;
        len -= take;
        if (buf_.size() == kBufferBytes) flush_buffer();
    }
}

uint32_t AtomicFile::commit() {
    flush_buffer();
    FILE* f = f_;
    f_ = nullptr;  // from here on the destructor must not close it again
    if (std::fclose(f) != 0) {
        std::remove(tmp_path_.c_str());
        fail(kExitInternal, tmp_path_ + ": close failed: " + errno_text(),
             "check free disk space in the output folder");
    }
    if (std::rename(tmp_path_.c_str(), final_path_.c_str()) != 0) {
        std::string why = errno_text();
        std::remove(tmp_path_.c_str());
        fail(kExitInternal, final_path_ + ": cannot rename " + tmp_path_ + " into place: " + why);
    }
    return crc_;
}

void OutputLog::remove_all() const {
    for (const Entry& e : entries_) std::remove(e.path.c_str());
}

void remove_if_exists(const std::string& path) {
    if (::access(path.c_str(), F_OK) != 0) return;
    if (std::remove(path.c_str()) != 0)
        fail(kExitBadInput, path + ": cannot remove the previous run's file: " + errno_text(),
             "check the output folder's permissions");
}

}  // namespace attnstep
