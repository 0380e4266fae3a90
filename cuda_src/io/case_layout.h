// case_layout.h — the input case folder of docs/contract.md: file names, and the checks that run
// before anything is written (every input file present, no head gaps, the manifest, in
// input_manifest.cpp, agrees with the files). The output folder's checks: output_folder.h.
#pragma once

#include <string>
#include <vector>

#include "../sequences.h"
#include "../stages.h"
#include "../variant.h"
#include "matrix_io.h"

namespace attnstep {

// "<stage>_head_<i>.<ext>" (seq >= 0: "<stage>_head_<i>_seq_<b>.<ext>"), by stage_file_name (stages.h).
std::string head_file_name(Stage s, int head, Format fmt, int seq = -1);

struct InputCase {
    std::string dir;       // as given, without trailing '/'
    bool has_manifest = false;
    Format format = Format::txt;
    Dims dims;
    bool causal = false;   // from the manifest (default false)
    Variant variant;       // the manifest's variant keys (defaults without them); variant.causal == causal
    // Where the manifest set causal and window_right ("" when it did not), for the message when the
    // command line's options combine them into a mask that cannot be.
    std::string where_causal, where_window_right;
    bool has_scale = false;
    double scale = 0;      // from the manifest when has_scale
    bool backward = false; // the case has the output gradient dO (its files, or the manifest's `backward`)
    bool has_slopes_file = false;  // alibi_slopes.<fmt>: the ALiBi slopes, else the standard ones
    // A packed case (sequences.h; the manifest's `sequences`, or without a manifest the cu_seqlens
    // files): the offsets, checked; dims.N and dims.M are the packed totals. Empty otherwise.
    Sequences sequences;
    bool packed() const { return sequences.packed(); }
    // input is an input echo stage (Q, K, V, dO); head a query head, or a K/V head for K and V
    std::string file(Stage input, int head) const;
    std::vector<Stage> inputs() const;               // Q, K, V, and dO when the case has it
};

// Finds and checks an input case; reads the manifest and probes head 0's shapes (and every .npy
// header), but reads no matrix values. Fails with exit 2 on any layout problem.
InputCase open_input_case(const std::string& dir);

// Fails with exit 2 (one line) when a case of these dimensions is beyond the case limits
// (stages.h case_limit_violation); `where` names what gave the dimensions. backward: the case has
// dO; dropout: the run has dropout (its keep-mask counts, as a stage of every query head).
void check_case_limits(const std::string& where, const Dims& d, bool backward, bool dropout);

// Reads file `head` of an input (Q, K, V or dO; K and V are numbered by K/V head) into dst, in its
// stage's shape.
void read_input(const InputCase& c, Stage input, int head, bool allow_nonfinite, float* dst);

}  // namespace attnstep
