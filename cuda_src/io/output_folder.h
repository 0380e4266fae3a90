// output_folder.h — the output case folder (--out), checked before anything is written.
#pragma once

#include <string>

namespace attnstep {

// Creates the output folder if needed and checks that it is writable, not the input folder and
// not another input case (outputs would overwrite inputs). Fails with exit 2.
void prepare_output_dir(const std::string& out_dir, const std::string& in_dir, const std::string& run_id);

}  // namespace attnstep
