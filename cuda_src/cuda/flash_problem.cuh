// flash_problem.cuh — what the flash forward's and backward's arguments share (FlashArgs in
// flash.cuh, FlashBwdArgs in flash_bwd.cuh): the inputs and the problem. All pointers are device
// memory; `heads` matrices lie back to back, row-major: Q [heads][N][d], K and V [heads][M][d].
#pragma once

#include "../backend.h"

namespace attnstep {

struct FlashProblem {
    const float* Q;
    const float* K;
    const float* V;
    int heads, N, M, d;
    float scale;      // multiplies q·k
    bool causal;      // top-left aligned: query r sees keys c <= r
    Precision precision;
};

}  // namespace attnstep
