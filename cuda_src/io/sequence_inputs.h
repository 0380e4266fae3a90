// sequence_inputs.h — the files of a packed case (docs/contract.md, "Packed sequences"):
// cu_seqlens_q, cu_seqlens_k and optionally seqused_k, in the case's format, and the rules a
// packed case meets. verify/files' reader of the same files refuses the same cases in the same words.
#pragma once

#include "case_layout.h"
#include "manifest.h"

namespace attnstep {

// The manifest of a packed case (`sequences = B`): B within 1..kMaxDim, batch = 1, no dropout.
// Called by open_input_case as soon as the manifest is applied, before any file is looked at.
void check_packed_manifest(const InputCase& c, const Manifest& m);

// Finds and reads the sequence files and sets c->sequences: a case is packed when its manifest has
// `sequences = B`, or, without a manifest, when it holds cu_seqlens_q or cu_seqlens_k. Refuses
// (exit 2, one line naming the file or the manifest's line) a sequence file in a case that is not
// packed, a missing one, a value that is not an integer, offsets sequences_problem refuses, and
// seq_q or seq_k other than the packed totals. Called
// by open_input_case once the dimensions are known (m: the manifest, null without one).
void check_sequence_files(InputCase* c, const Manifest* m);

// A packed case refuses mask and bias files (called once check_variant_files has set the case's
// coverage; m as above).
void check_packed_variant(const InputCase& c, const Manifest* m);

// "--dropout P" on a packed case: refused as the manifest's dropout is.
void check_packed_dropout_option(const InputCase& c, double dropout);

}  // namespace attnstep
