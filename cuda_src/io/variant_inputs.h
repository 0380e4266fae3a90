// variant_inputs.h — the variant's input files of a case (docs/contract.md): a mask and an additive
// bias, each N×M per query head (`mask_head_<i>`) or one file broadcast over the heads (`mask`),
// and the ALiBi slopes (`alibi_slopes`: 1 or batch rows of `heads` slopes), in the case's format.
// They are found and checked before a run writes anything (a declared file missing, a file the
// case does not declare, values a mask, bias or slope cannot hold: one line, exit 2); the per-head
// files are read with their head group.
#pragma once

#include <string>
#include <vector>

#include "../backend.h"
#include "case_layout.h"

namespace attnstep {

// Checks the case's mask, bias and slopes files against its variant (the manifest's `mask` and
// `bias`; without a manifest they are what the files are: mask_head_<i> files per head, a mask
// file broadcast) and sets c->variant.mask, .bias and c->has_slopes_file. Reads head 0's
// per-head files strictly. Called by open_input_case.
void check_variant_files(InputCase* c);

// The variant's inputs of a run: the broadcast mask/bias and the slopes are read at construction
// (before the output folder is touched: they are part of checking the case), the per-head files
// with each head group.
class VariantInputs {
public:
    // Fails when the case holds a slopes file but the run has no ALiBi (the file would be ignored).
    VariantInputs(const InputCase& c, const Problem& p);
    // Points g's mask, bias and alibi_slopes at the group's heads, reading its per-head files.
    void read_group(HeadGroup& g);

private:
    const InputCase& c_;
    Variant v_;
    std::vector<float> mask_, bias_, slopes_;
};

}  // namespace attnstep
