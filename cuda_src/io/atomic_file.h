// atomic_file.h — output files that appear only when complete, and a record of what a run wrote.
// Every output is written to "<name>.tmp-<run_id>" and renamed into place by commit(), so a reader
// never sees a half-written file; OutputLog remembers the files a run committed, with their CRC-32
// for run.toml (a whole run appears at once through io/run_folder.h).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace attnstep {

class AtomicFile {
public:
    AtomicFile(const std::string& final_path, const std::string& run_id);
    ~AtomicFile();  // removes the temporary file if commit() was not reached
    AtomicFile(const AtomicFile&) = delete;
    AtomicFile& operator=(const AtomicFile&) = delete;

    // Buffered write; the CRC-32 covers every byte written.
    void write(const void* data, size_t len);
    void write(const std::string& s) { write(s.data(), s.size()); }
    // Flushes, closes and renames into place; returns the CRC-32 of the file's bytes.
    uint32_t commit();
    const std::string& path() const { return final_path_; }

private:
    void flush_buffer();
    std::string final_path_, tmp_path_;
    FILE* f_ = nullptr;
    std::vector<char> buf_;
    uint32_t crc_ = 0;
};

// The files one run has committed, in order, with their CRC-32.
class OutputLog {
public:
    struct Entry {
        std::string name, key;  // name: the file's name in the run's folder; key: e.g. "QK_head_3", for run.toml's crc32_<key>
        uint32_t crc;
    };
    void add(const std::string& name, const std::string& key, uint32_t crc) {
        entries_.push_back({name, key, crc});
    }
    const std::vector<Entry>& entries() const { return entries_; }

private:
    std::vector<Entry> entries_;
};

// A new run id, unique per run: "<UTC time>-<process id>-<32 random bits>", e.g.
// 20250101T120000Z-4242-0badf00d. Every temporary file's name ends in ".tmp-<run id>".
std::string make_run_id();

// The process id inside a run id made by make_run_id(); 0 when `id` is not one.
long run_id_pid(const std::string& id);

// True when no process `pid` exists any more (or it is this process, whose leftovers these are not).
bool process_gone(long pid);

// Removes the temporary files ("<name>.tmp-<run id>") in `dir` that runs other than `own_run_id`
// left behind when they were killed: those whose run id names a process that no longer exists.
// Returns how many were removed.
int remove_stale_temporaries(const std::string& dir, const std::string& own_run_id);

// The temporary name AtomicFile writes `final_path` under.
std::string temporary_path(const std::string& final_path, const std::string& run_id);

}  // namespace attnstep
