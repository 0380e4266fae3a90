// stages.cpp — parsing a --stages list against the one stage table in stages.h.
#include "stages.h"

namespace attnstep {

namespace {

// Adds the stages a single token names; false when the token names nothing.
bool add_token(const std::string& tok, StageSet* out) {
    if (tok == "all") { out->bits |= StageSet::all().bits; return true; }
    bool group_stages = tok == "stages", group_flash = tok == "flash";
    bool found = false;
    for (int i = 0; i < kNumStages; ++i) {
        Stage s = static_cast<Stage>(i);
        bool take = (group_stages && !is_flash_stage(s)) || (group_flash && is_flash_stage(s)) ||
                    tok == stage_name(s);
        if (take) { out->add(s); found = true; }
    }
    return found;
}

}  // namespace

bool parse_stage_list(const std::string& text, StageSet* out, std::string* bad) {
    StageSet sel;
    size_t start = 0;
    while (true) {
        size_t comma = text.find(',', start);
        std::string tok = text.substr(start, comma == std::string::npos ? std::string::npos
                                                                       : comma - start);
        if (!add_token(tok, &sel)) {
            *bad = tok;
            return false;
        }
        if (comma == std::string::npos) break;
        start = comma + 1;
    }
    *out = sel;
    return true;
}

}  // namespace attnstep
