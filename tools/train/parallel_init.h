// Normal initialization of a large weight on every core, reproducible from the seed alone.
//
// LibTorch draws its CPU random numbers from one Mersenne Twister on one thread: 350-470 M values
// a second on an AMD Zen 5 core (normal_, uniform_), so initializing a 20B-parameter model that
// way (twice over for a stock Linear, whose constructor runs kaiming_uniform_ before the model's
// own normal_) takes minutes before the first step. ParallelNormal draws the values from a
// counter-based generator instead (Note [parallel normal] in parallel_init.cc): each value is a
// function of a key and its index, so the result is the same on any number of threads.
#pragma once

#include <cstdint>

#include <torch/torch.h>

#include "tools/train/parallel_init_threshold.h"

namespace strata::models {

// Fills `w` (contiguous fp32 on the CPU) with values of N(mean, std^2), drawn by Box-Muller from
// a 23-bit and a 24-bit uniform (so within about 5.8 std of the mean), a function of `key` and
// each element's index only. Independent of LibTorch's generator and of the number of threads.
void ParallelNormal(torch::Tensor w, double mean, double std, uint64_t key);

// A key for ParallelNormal from LibTorch's default CPU generator (one 63-bit draw), so that
// torch::manual_seed decides it as it decides every other draw of the model.
uint64_t DrawInitKey();

}  // namespace strata::models
