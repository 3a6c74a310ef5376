// A decoder-only GPT built from standard LibTorch layers, as a Sequential of blocks the engine can
// materialize one at a time: Embedding -> Block x n_layers -> Head.
//
// Its linear layers use StrataLinear: the same math as torch::nn::Linear, but its autograd node
// saves the weight parameter itself rather than a transposed view of the weight's storage. A
// view would keep the gathered chunk alive from forward to backward and defeat ZeRO-3's release
// of parameters between them (Note [saved views] in gpt.cc).
#pragma once

#include <torch/torch.h>

#include "runtime/config.h"

namespace strata::models {

// y = x W^T + b with a memory-friendly backward.
class StrataLinearImpl : public torch::nn::Module {
 public:
  StrataLinearImpl(int64_t in, int64_t out);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight, bias;
};
TORCH_MODULE(StrataLinear);

class GptEmbeddingImpl : public torch::nn::Module {
 public:
  explicit GptEmbeddingImpl(const ModelConfig& c);
  torch::Tensor forward(const torch::Tensor& tokens);  // [B, T] int64 -> [B, T, d]
  torch::nn::Embedding tok{nullptr};
  torch::Tensor pos;
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(GptEmbedding);

class GptBlockImpl : public torch::nn::Module {
 public:
  explicit GptBlockImpl(const ModelConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  int64_t n_heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  StrataLinear qkv{nullptr}, proj{nullptr}, fc{nullptr}, out{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::Tensor mask;  // buffer: causal, [T, T]
};
TORCH_MODULE(GptBlock);

class GptHeadImpl : public torch::nn::Module {
 public:
  explicit GptHeadImpl(const ModelConfig& c);
  torch::Tensor forward(const torch::Tensor& x);  // [B, T, d] -> [B, T, vocab]
  torch::nn::LayerNorm ln{nullptr};
  StrataLinear lm{nullptr};
};
TORCH_MODULE(GptHead);

// Builds the model with deterministic initialization from c.seed (GPT-2 style: normal(0, 0.02)
// weights, zero biases).
torch::nn::Sequential BuildGpt(const ModelConfig& c);

// Mean next-token cross entropy, computed in fp32. logits [B, T, V], targets [B, T].
torch::Tensor LanguageModelLoss(const torch::Tensor& logits, const torch::Tensor& targets);

// Trainable parameters of a model built from `c` (no model is built).
int64_t GptParameterCount(const ModelConfig& c);

}  // namespace strata::models
