// atomic_file.cpp — temp-file-and-rename writing; see atomic_file.h.
#include "atomic_file.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <csignal>
#include <ctime>
#include <dirent.h>
#include <random>
#include <sys/stat.h>
#include <unistd.h>

#include "../common.h"
#include "crc32.h"

namespace attnstep {

namespace {
constexpr size_t kBufferBytes = 1u << 20;
const char kTmpMark[] = ".tmp-";

std::string errno_text() { return std::strerror(errno); }

bool all_of(const std::string& s, size_t from, size_t n, const char* chars) {
    if (from + n > s.size()) return false;
    for (size_t i = from; i < from + n; ++i)
        if (!std::strchr(chars, s[i]) || !s[i]) return false;
    return true;
}

}  // namespace

long run_id_pid(const std::string& id) {
    const char* digits = "0123456789";
    // yyyymmddThhmmssZ-
    if (!all_of(id, 0, 8, digits) || id.compare(8, 1, "T") != 0 || !all_of(id, 9, 6, digits) ||
        id.compare(15, 2, "Z-") != 0)
        return 0;
    size_t dash = id.find('-', 17);
    if (dash == std::string::npos || dash == 17 || dash - 17 > 9 || !all_of(id, 17, dash - 17, digits) ||
        id.size() != dash + 9 || !all_of(id, dash + 1, 8, "0123456789abcdef"))
        return 0;
    return std::stol(id.substr(17, dash - 17));
}

bool process_gone(long pid) {
    if (pid == static_cast<long>(::getpid())) return true;
    return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

std::string make_run_id() {
    std::time_t now = std::time(nullptr);
    char t[32];
    std::strftime(t, sizeof t, "%Y%m%dT%H%M%SZ", std::gmtime(&now));
    std::random_device rd;
    char buf[80];
    std::snprintf(buf, sizeof buf, "%s-%d-%08x", t, static_cast<int>(::getpid()), static_cast<unsigned>(rd()));
    return buf;
}

std::string temporary_path(const std::string& final_path, const std::string& run_id) {
    return final_path + kTmpMark + run_id;
}

int remove_stale_temporaries(const std::string& dir, const std::string& own_run_id) {
    DIR* d = ::opendir(dir.c_str());
    if (!d) return 0;
    int removed = 0;
    while (const struct dirent* e = ::readdir(d)) {
        const std::string name = e->d_name;
        const size_t mark = name.rfind(kTmpMark);
        if (mark == std::string::npos || mark == 0) continue;
        const std::string id = name.substr(mark + std::strlen(kTmpMark));
        const long pid = run_id_pid(id);
        if (pid <= 0 || id == own_run_id || !process_gone(pid)) continue;
        const std::string path = dir + "/" + name;
        struct stat st;
        if (::lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && std::remove(path.c_str()) == 0) ++removed;
    }
    ::closedir(d);
    return removed;
}

AtomicFile::AtomicFile(const std::string& final_path, const std::string& run_id)
    : final_path_(final_path), tmp_path_(temporary_path(final_path, run_id)) {
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

}  // namespace attnstep
