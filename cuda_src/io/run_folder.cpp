// run_folder.cpp — the output folder's run protocol and the signals that can interrupt it; see
// run_folder.h.
#include "run_folder.h"

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <dirent.h>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <sys/stat.h>
#include <system_error>
#include <unistd.h>

#include "../common.h"
#include "../stages.h"
#include "atomic_file.h"
#include "manifest.h"
#include "matrix_io.h"

namespace fs = std::filesystem;

namespace attnstep {

namespace {

std::string join(const std::string& dir, const std::string& name) { return dir + "/" + name; }

// A head number as the binary writes it: digits, no leading zero.
bool head_number(const std::string& s) {
    if (s.empty() || (s.size() > 1 && s[0] == '0')) return false;
    for (char c : s)
        if (c < '0' || c > '9') return false;
    return true;
}

// The entries of a folder (no "." or ".."); empty when it cannot be read.
std::vector<std::string> entries(const std::string& dir) {
    std::vector<std::string> out;
    DIR* d = ::opendir(dir.c_str());
    if (!d) return out;
    while (const struct dirent* e = ::readdir(d)) {
        std::string name = e->d_name;
        if (name != "." && name != "..") out.push_back(name);
    }
    ::closedir(d);
    return out;
}

// Field `n` (1-based, as proc(5) numbers them) of /proc/<pid>/stat; 0 where unknown. Fields from
// the third on follow the command name, which may hold spaces and parentheses: counted after the
// last ')'.
long long proc_stat_field(long pid, int n) {
    std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    size_t close = text.rfind(')');
    if (close == std::string::npos) return 0;
    std::istringstream rest(text.substr(close + 1));
    std::string field;
    for (int i = 3; i <= n && rest >> field; ++i)
        if (i == n) return std::atoll(field.c_str());
    return 0;
}

// The process's start time in clock ticks after boot (field 22): with the process id it names one
// process, even after the id is reused.
long long process_start_ticks(long pid) { return proc_stat_field(pid, 22); }

// The parent process of `pid` (field 4).
long parent_of(long pid) { return static_cast<long>(proc_stat_field(pid, 4)); }

// Whether `pid` started this process (its parent, or further up): `attnstep run` marks the folder
// for the program it runs, which may be this binary, directly or under a tool.
bool is_ancestor(long pid) {
    long p = static_cast<long>(::getppid());
    for (int depth = 0; p > 1 && depth < 16; ++depth, p = parent_of(p))
        if (p == pid) return true;
    return false;
}

std::string utc_now() {
    std::time_t now = std::time(nullptr);
    char t[32];
    std::strftime(t, sizeof t, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    return t;
}

void rename_or_fail(const std::string& from, const std::string& to) {
    if (std::rename(from.c_str(), to.c_str()) != 0)
        fail(kExitInternal, "cannot move " + from + " to " + to + ": " + std::strerror(errno),
             "check the output folder's permissions and free space, then run again");
}

// The signals held back while a finished run is put in place (those catch_signals handles).
sigset_t held_signals();
extern volatile std::sig_atomic_t g_committing;

}  // namespace

bool is_run_file_name(const std::string& name) {
    if (name == kRunManifest) return true;
    const size_t head = name.find(kHeadInfix), dot = name.rfind('.');
    if (head == std::string::npos || dot == std::string::npos || dot < head) return false;
    const size_t index_at = head + std::string(kHeadInfix).size();
    std::string index = name.substr(index_at, dot - index_at);
    const std::string stage = name.substr(0, head), ext = name.substr(dot + 1);
    // A score stage of a packed run: "<stage>_head_<i>_seq_<b>"; a split of a split stage:
    // "<stage>_head_<i>_split_<s>".
    const size_t seq = index.find(kSequenceInfix), split = index.find(kSplitInfix);
    bool score = false, one_split = false;
    if (seq != std::string::npos) {
        if (!head_number(index.substr(seq + std::string(kSequenceInfix).size()))) return false;
        index.resize(seq);
        score = true;
    } else if (split != std::string::npos) {
        if (!head_number(index.substr(split + std::string(kSplitInfix).size()))) return false;
        index.resize(split);
        one_split = true;
    }
    bool known = false;
    for (int i = 0; i < kNumStages && !known; ++i) {
        const Stage s = static_cast<Stage>(i);
        known = stage == stage_name(s) && (!score || is_score_stage(s)) && one_split == is_split_stage(s);
    }
    return known && head_number(index) && (ext == format_name(Format::txt) || ext == format_name(Format::npy));
}

RunFolder::RunFolder(const std::string& out_dir, const std::string& run_id)
    : out_(out_dir), run_id_(run_id), staging_(join(out_dir, kStagingPrefix + run_id)),
      marker_(join(out_dir, kUnfinishedMarker)) {}

bool holds_run_traces(const std::string& out_dir) {
    struct stat st;
    return ::lstat(join(out_dir, kUnfinishedMarker).c_str(), &st) == 0 ||
           ::lstat(join(out_dir, kPreviousFolder).c_str(), &st) == 0;
}

// Two runs into one folder would put each other's files in place: the second is refused while
// the first one's process runs (the same process: its start time in the marker tells a reused id).
void RunFolder::refuse_live_writer() const {
    struct stat st;
    if (::stat(marker_.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
    Manifest m;
    try {
        m = read_manifest(marker_);
    } catch (const Error&) {
        return;  // unreadable: the writer is not known to run, and this run replaces the marker
    }
    const ManifestValue *pid = m.find("pid"), *start = m.find("pid_start"), *state = m.find("state");
    if (!pid || pid->kind != ManifestValue::Int || !state || state->s != "running" || process_gone(pid->i) ||
        is_ancestor(pid->i))
        return;
    if (start && start->kind == ManifestValue::Int && start->i && process_start_ticks(pid->i) != start->i) return;
    fail(kExitBadInput, out_ + ": another run (process " + std::to_string(pid->i) + ") is writing into this folder",
         "wait for it to finish, or pass another --out");
}

void RunFolder::begin() {
    refuse_live_writer();
    int removed = 0;
    for (const std::string& name : entries(out_)) {
        if (name.rfind(kStagingPrefix, 0) != 0) continue;
        const long pid = run_id_pid(name.substr(std::strlen(kStagingPrefix)));
        if (pid <= 0 || !process_gone(pid)) continue;
        std::error_code ec;
        if (fs::remove_all(join(out_, name), ec) != static_cast<std::uintmax_t>(-1) && !ec) ++removed;
    }
    if (removed)
        std::fprintf(stderr, "main: notice: removed %s left in %s by runs that were killed\n",
                     plural(removed, "staging folder").c_str(), out_.c_str());
    write_marker("running", "");
    begun_ = true;
    if (::mkdir(staging_.c_str(), 0777) != 0)
        fail(kExitBadInput, staging_ + ": cannot create the staging folder: " + std::strerror(errno),
             "pass --out a folder you can write to");
}

void RunFolder::write_marker(const std::string& state, const std::string& reason) const {
    ManifestWriter w;
    w.comment("attnstep: a run into this folder has not finished (docs/contract.md); the next run removes this");
    w.add("run_id", run_id_);
    w.add("pid", static_cast<long long>(::getpid()));
    w.add("pid_start", process_start_ticks(::getpid()));
    w.add("started", utc_now());
    w.add("state", state);
    w.add("reason", reason);
    AtomicFile f(marker_, run_id_);
    f.write(w.text());
    f.commit();
}

// The previous run's files (run.toml first, so that no moment shows it beside new files) go into
// OUT/.attnstep-previous, which holds one run: what an earlier move left there is replaced.
void RunFolder::move_previous_aside() const {
    const std::string previous = join(out_, kPreviousFolder);
    std::vector<std::string> names;
    for (const std::string& name : entries(out_)) {
        struct stat st;
        if (is_run_file_name(name) && ::lstat(join(out_, name).c_str(), &st) == 0 && !S_ISDIR(st.st_mode))
            names.push_back(name);
    }
    if (names.empty()) return;  // what an earlier move left there stays: it is still the run before
    std::error_code ec;
    fs::remove_all(previous, ec);  // a link there is removed, never followed
    if (::mkdir(previous.c_str(), 0777) != 0)
        fail(kExitInternal, previous + ": cannot create: " + std::strerror(errno),
             "check the output folder's permissions");
    std::stable_partition(names.begin(), names.end(), [](const std::string& n) { return n == kRunManifest; });
    for (const std::string& name : names) rename_or_fail(join(out_, name), join(previous, name));
}

void RunFolder::commit(const std::vector<std::string>& names) {
    sigset_t held = held_signals(), before;
    ::sigprocmask(SIG_BLOCK, &held, &before);
    g_committing = 1;
    try {
        move_previous_aside();
        for (const std::string& name : names)
            if (name != kRunManifest) rename_or_fail(join(staging_, name), join(out_, name));
        rename_or_fail(join(staging_, kRunManifest), join(out_, kRunManifest));
        committed_ = true;
        std::remove(join(out_, kProgramChecks).c_str());  // they were about the run just replaced
        std::remove(marker_.c_str());
        std::error_code ec;
        fs::remove_all(staging_, ec);
    } catch (...) {
        g_committing = 0;
        ::sigprocmask(SIG_SETMASK, &before, nullptr);
        throw;
    }
    g_committing = 0;
    ::sigprocmask(SIG_SETMASK, &before, nullptr);
}

void RunFolder::abandon(const std::string& reason) noexcept {
    if (!begun_ || committed_) return;
    try {
        std::error_code ec;
        fs::remove_all(staging_, ec);
        write_marker("failed", reason);
    } catch (...) {
        // The marker written by begin() still says that this run did not finish.
    }
}

// ---------------------------------------------------------------- signals
namespace {
// What ends a run by default and can be caught: each is recorded and the run stops between two
// files, like any failure (the handler restores the default, so a second one ends it at once).
const struct {
    int sig;
    const char* name;
} kCaught[] = {{SIGHUP, "SIGHUP"},   {SIGINT, "SIGINT"},   {SIGQUIT, "SIGQUIT"},     {SIGTERM, "SIGTERM"},
               {SIGUSR1, "SIGUSR1"}, {SIGUSR2, "SIGUSR2"}, {SIGALRM, "SIGALRM"},     {SIGXCPU, "SIGXCPU"},
               {SIGVTALRM, "SIGVTALRM"}, {SIGPROF, "SIGPROF"}};
// Ignored, so that the write fails with an error the run reports (EPIPE, EFBIG) instead of the
// process ending without a word.
const int kIgnored[] = {SIGPIPE, SIGXFSZ};

volatile std::sig_atomic_t g_signal = 0;
// Set while a finished run is put in place. Blocking the signals there covers this thread only,
// and the CUDA runtime's own threads may take one: the handler then keeps itself installed, so
// that a second signal too waits for the renames to end.
volatile std::sig_atomic_t g_committing = 0;
extern "C" void on_signal(int sig) {
    g_signal = sig;
    if (!g_committing) std::signal(sig, SIG_DFL);
}

sigset_t held_signals() {
    sigset_t set;
    sigemptyset(&set);
    for (const auto& c : kCaught) sigaddset(&set, c.sig);
    return set;
}
}  // namespace

void catch_signals() {
    for (const auto& c : kCaught) std::signal(c.sig, on_signal);
    for (int sig : kIgnored) std::signal(sig, SIG_IGN);
}

int pending_signal() { return g_signal; }

std::string signal_words(int sig) {
    for (const auto& c : kCaught)
        if (c.sig == sig) return "signal " + std::to_string(sig) + " (" + c.name + ")";
    return "signal " + std::to_string(sig);
}

void check_interrupted(bool begun) {
    if (g_signal)
        fail(128 + g_signal, "interrupted by " + signal_words(g_signal),
             begun ? "the output folder keeps the files of the run before, marked as unfinished"
                   : "the run had not begun: the output folder was not touched");
}

}  // namespace attnstep
