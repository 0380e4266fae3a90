// run_folder.h — how a run replaces the output folder's previous run all at once, so that the
// folder holds a complete run or says that it does not (docs/contract.md, "A run is complete or it
// is not there"):
//   begin():  writes the marker OUT/.attnstep-unfinished (run id, process, state "running") and
//             creates the staging folder OUT/.attnstep-staging-<run id>; every file of the run is
//             written there, the previous run's files stay untouched;
//   commit(): moves the previous run's files into OUT/.attnstep-previous, the new ones into OUT
//             (run.toml last), removes the marker and the staging folder; catchable signals are
//             held back meanwhile, so only SIGKILL can stop it half-way, and then the marker stays;
//   abandon(reason): on any failure, removes the staging folder and rewrites the marker with
//             state "failed" and the reason, so `attnstep check` refuses the folder in one line
//             instead of passing the previous run's files as if they were this run's.
// A staging folder or a marker of a run whose process is gone is removed by the next run.
#pragma once

#include <string>
#include <vector>

namespace attnstep {

// The names this protocol uses inside OUT; verify/stages.py holds the same ones. A run's commit
// removes the findings `attnstep run --sanitize/--repeat` wrote about the run before it.
inline constexpr const char* kRunManifest = "run.toml";  // written last, so a run is complete when it is there
inline constexpr const char* kUnfinishedMarker = ".attnstep-unfinished";
inline constexpr const char* kStagingPrefix = ".attnstep-staging-";
inline constexpr const char* kPreviousFolder = ".attnstep-previous";
inline constexpr const char* kProgramChecks = "program_checks.toml";

// Whether OUT shows this protocol's traces (a marker, a previous run moved aside): then it is an
// output folder, whatever files a killed run left in it.
bool holds_run_traces(const std::string& out_dir);

// Whether `name` is a file a run of this binary writes: run.toml, <stage>_head_<i>.<txt|npy>,
// (a score stage of a packed run) <stage>_head_<i>_seq_<b>.<txt|npy>, or (a split stage)
// <stage>_head_<i>_split_<s>.<txt|npy>; i, b and s numbers as the binary writes them (digits, no
// leading zero).
bool is_run_file_name(const std::string& name);

class RunFolder {
public:
    RunFolder(const std::string& out_dir, const std::string& run_id);
    // Removes dead runs' staging folders (a notice says how many), writes the marker, creates the
    // staging folder. Fails (exit 2) when the folder cannot take them.
    void begin();
    // Where this run writes its files until commit().
    const std::string& staging() const { return staging_; }
    // Puts the staged files (`names`, run.toml among them) in place of the previous run's.
    void commit(const std::vector<std::string>& names);
    // Never throws: a failure while cleaning up must not hide the failure that caused it.
    void abandon(const std::string& reason) noexcept;

private:
    void write_marker(const std::string& state, const std::string& reason) const;
    void refuse_live_writer() const;
    void move_previous_aside() const;
    std::string out_, run_id_, staging_, marker_;
    bool begun_ = false, committed_ = false;
};

// Signals: catch_signals() makes every signal that ends a process by default and can be caught a
// recorded request to stop (the run then fails between two files, like any error, with exit status
// 128 + signal); SIGPIPE and SIGXFSZ are ignored, so the write they would end fails with its error.
void catch_signals();
int pending_signal();                 // 0: none arrived
std::string signal_words(int sig);    // "signal 15 (SIGTERM)"
void check_interrupted(bool begun = true);  // fails when a signal arrived (begun: the marker is written)

}  // namespace attnstep
