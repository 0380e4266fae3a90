// output_folder.cpp — the checks on --out before a run writes anything (output_folder.h).
#include "output_folder.h"

#include <cstdio>
#include <filesystem>
#include <sys/stat.h>
#include <system_error>

#include "../common.h"
#include "../stages.h"
#include "atomic_file.h"
#include "input_manifest.h"
#include "run_folder.h"

namespace fs = std::filesystem;

namespace attnstep {

namespace {

std::string join(const std::string& dir, const std::string& name) { return dir + "/" + name; }

// Compared as files (device and inode), not as paths: a symlink or a bind mount reaches the same
// folder by another path.
bool same_folder(const std::string& a, const std::string& b) {
    struct stat sa, sb;
    return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev &&
           sa.st_ino == sb.st_ino;
}

// What an input case folder holds and an output folder does not: the input manifest, or input
// files (Q, K, V, dO per head) with no run.toml and no other stage beside them (an output folder
// echoes the inputs beside the stages it computed). Empty when `dir` looks like no input case.
std::string input_case_sign(const std::string& dir) {
    if (fs::exists(join(dir, kInputManifestName))) return kInputManifestName;
    if (holds_run_traces(dir)) return "";  // a run's folder, whatever a killed run left in it
    std::string input;
    bool other_stage = false;
    std::error_code ec;
    for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
        const std::string name = e.path().filename().string();
        if (name == kRunManifest) return "";
        if (!is_run_file_name(name)) continue;
        const std::string stage = name.substr(0, name.find("_head_"));
        bool is_input = false;
        for (Stage s : input_stages()) is_input = is_input || stage == stage_name(s);
        if (is_input) input = name;
        else other_stage = true;
    }
    return other_stage ? "" : input;
}

}  // namespace

void prepare_output_dir(const std::string& out_dir, const std::string& in_dir, const std::string& run_id) {
    std::error_code ec;
    if (fs::exists(out_dir, ec) && !fs::is_directory(out_dir, ec))
        fail(kExitBadInput, out_dir + ": exists and is not a folder", "pass --out a folder path");
    fs::create_directories(out_dir, ec);
    if (ec || !fs::is_directory(out_dir))
        fail(kExitBadInput, out_dir + ": cannot create the output folder: " +
                                (ec ? ec.message() : std::string("not a folder")),
             "pass --out a folder you can write to");
    if (same_folder(out_dir, in_dir))
        fail(kExitBadInput, out_dir + ": the output folder is the input folder (" + in_dir + ")",
             "outputs would overwrite the inputs; pass a different --out");
    const std::string sign = input_case_sign(out_dir);
    if (!sign.empty())
        fail(kExitBadInput, out_dir + ": holds an input case (" + sign + "), not a run's output",
             "its inputs would be replaced; pass an --out folder of its own");
    // A real write is the only reliable test (permission bits say nothing on read-only mounts or
    // for root).
    std::string probe = temporary_path(join(out_dir, ".attnstep-probe"), run_id);
    FILE* f = std::fopen(probe.c_str(), "wb");
    if (!f)
        fail(kExitBadInput, out_dir + ": the output folder is not writable",
             "pass --out a folder you can write to");
    std::fclose(f);
    std::remove(probe.c_str());
}

}  // namespace attnstep
