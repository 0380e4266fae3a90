// new_key_inputs.h — a decode step's new keys in an input case (docs/contract.md, "New keys: a
// decode step"): the manifest's new_keys = n and the files K_new_head_<j>, V_new_head_<j> ((B*n) x d
// per K/V head). Sequence b's new keys are written at its keys seqused_k[b] .. seqused_k[b] + n - 1
// (through its block_table row when paged) as the cache is read, on the host, so every backend
// computes the step from the cache after it and K and V echo that cache. verify/files/new_keys.py
// refuses the same cases in the same words.
#pragma once

#include "case_layout.h"
#include "manifest.h"

namespace attnstep {

// The manifest's new_keys: without sequences, or out of 1..kMaxTokens, exit 2 (one line). Called by
// check_packed_manifest.
void check_new_keys_manifest(const Manifest& m);

// The new-key files and the rules of appending them, in the Python reader's order: a file without a
// manifest or without new_keys, the backward pass, seqused_k missing, no room (new_keys_problem),
// a missing file, a file of the other format or beyond the K/V heads. Then c->sequences counts the
// new keys (used_k is the keys each sequence attends to). Called by check_sequence_files last.
void check_new_key_files(InputCase* c, const Manifest* m);

// Writes K/V head `head`'s new keys (input: Stage::K) or values (Stage::V) into its cache `pool`
// (seq_k x d rows, as read_input read it).
void append_new_keys(const InputCase& c, Stage input, int head, bool allow_nonfinite, float* pool);

}  // namespace attnstep
