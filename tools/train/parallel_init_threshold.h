// Which of strata-train's GPT weights are drawn by ParallelNormal (parallel_init.h), torch-free so
// that the planner (tools/planner/model_spec.cc), which mirrors the model without building it,
// reads the same threshold as the model's constructor (MakeLinear in gpt.cc).
#pragma once

#include <cstdint>

namespace strata::models {

// Linear weights with at least this many elements are initialized by ParallelNormal; smaller
// ones keep LibTorch's generator, so that the models of the tests, the convergence benchmark and
// the quick start draw exactly what they always drew. 2^24 is a 4096 x 4096 matrix: a GPT
// block's fc and out weights (4d x d) reach it from width 2048, qkv (3d x d) from about 2365,
// all four from 4096. Under a zero::Init such a weight is registered with its draw and never
// written to the staging file (zero::StageGenerated).
inline constexpr int64_t kParallelInitMinNumel = int64_t{1} << 24;

}  // namespace strata::models
