// stages.cpp — parsing a --stages list against the one stage table in stages.h.
#include "stages.h"

namespace attnstep {

namespace {

// The stages a group token names; empty when the token is not a group.
StageSet group(const std::string& tok) {
    if (tok == "all") return StageSet::all();
    if (tok == "stages") return StageSet::all().minus(StageSet::flash());
    if (tok == "flash") return StageSet::flash();
    return {};
}

// Adds the stages a single token names (a stage name also to `named`); false when the token names
// nothing.
bool add_token(const std::string& tok, StageSet* out, StageSet* named) {
    const StageSet g = group(tok);
    out->bits |= g.bits;
    for (int i = 0; i < kNumStages; ++i) {
        const Stage s = static_cast<Stage>(i);
        if (tok != stage_name(s)) continue;
        out->add(s);
        named->add(s);
        return true;
    }
    return !g.empty();
}

}  // namespace

bool parse_stage_list(const std::string& text, StageSet* out, std::string* bad, StageSet* named) {
    StageSet sel, by_name;
    size_t start = 0;
    while (true) {
        size_t comma = text.find(',', start);
        std::string tok = text.substr(start, comma == std::string::npos ? std::string::npos
                                                                       : comma - start);
        if (!add_token(tok, &sel, &by_name)) {
            *bad = tok;
            return false;
        }
        if (comma == std::string::npos) break;
        start = comma + 1;
    }
    *out = sel;
    if (named) *named = by_name;
    return true;
}

}  // namespace attnstep
