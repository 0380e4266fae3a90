// sequence_inputs.h — the files of a packed case (docs/contract.md, "Packed sequences"):
// cu_seqlens_q, cu_seqlens_k and optionally seqused_k, in the case's format, and the rules a
// packed case meets. verify/files' reader of the same files refuses the same cases in the same words.
#pragma once

#include "case_layout.h"
#include "manifest.h"

namespace attnstep {

// The manifest of a packed case (`sequences = B`): B within 1..kMaxTokens, batch = 1. Called by
// open_input_case as soon as the manifest is applied, before any file is looked at.
void check_packed_manifest(const InputCase& c, const Manifest& m);

// Finds and reads the sequence files and sets c->sequences: a case is packed when its manifest has
// `sequences = B`, or, without a manifest, when it holds cu_seqlens_q or cu_seqlens_k. Refuses
// (exit 2, one line naming the file or the manifest's line), in this order as the Python reader
// (verify/files/sequence_files.py case_sequences): a sequence file in a case that is not packed or
// of the other format, mask or bias files or dropout, a missing offsets file, a value that is not a
// count of tokens, a count of offsets other than the manifest's B + 1, offsets sequences_problem
// refuses, and seq_q or seq_k other than the packed totals; then a decode step's new keys
// (new_key_inputs.h check_new_key_files). Called by open_input_case once the dimensions are known
// (m: the manifest, null without one).
void check_sequence_files(InputCase* c, const Manifest* m);

// "--dropout P" on a packed case: refused as the manifest's dropout is.
void check_packed_dropout_option(const InputCase& c, double dropout);

}  // namespace attnstep
