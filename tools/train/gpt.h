// A decoder-only GPT built only from stock LibTorch layers (Embedding, LayerNorm, Linear,
// Dropout), GPT-2 style: the head shares the token embedding's weight, and the causal mask is a
// buffer of the model passed to every block. It is not a Sequential: its forward runs its units
// (the embedding, each block, the head) through strata::RunUnit, so the same model trains with
// plain LibTorch (the equivalence tests' reference) and through the engine.
#pragma once

#include <vector>

#include <torch/torch.h>

#include "runtime/base/config.h"

namespace strata::models {

class GptEmbeddingImpl : public torch::nn::Module {
 public:
  explicit GptEmbeddingImpl(const ModelConfig& c);
  torch::Tensor forward(const torch::Tensor& tokens);  // [B, T] int64 -> [B, T, d]
  torch::Tensor pos;
  torch::nn::Embedding tok{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(GptEmbedding);

// Which attention a GptBlock computes with. kAuto: LibTorch's fused
// scaled_dot_product_attention where the linked LibTorch has it (2.x: flash or memory-efficient
// kernels on a GPU, no [T, T] score matrix kept for backward), else the explicit
// matmul-mask-softmax path (LibTorch 1.13). kFused where it is missing is an error.
enum class AttentionPath { kAuto, kExplicit, kFused };
bool FusedAttentionAvailable();

// Causal self-attention: q, k, v [B, H, T, hd] -> [B, H, T, hd]; mask [T, T] bool, the causal
// (lower-triangular) mask, which the fused path applies as is_causal. Dropout on the attention
// weights with probability dropout_p (0 in eval).
torch::Tensor CausalAttention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& mask, double dropout_p, AttentionPath path);

class GptBlockImpl : public torch::nn::Module {
 public:
  explicit GptBlockImpl(const ModelConfig& c);
  // x [B, T, d]; mask [T, T] bool, the causal mask (true where a position may attend).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& mask);
  AttentionPath attention = AttentionPath::kAuto;
  int64_t n_heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, out{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(GptBlock);

// Final LayerNorm and the language-model projection, whose weight is the token embedding's
// (the Embedding module is registered here a second time: a tied parameter).
class GptHeadImpl : public torch::nn::Module {
 public:
  GptHeadImpl(const ModelConfig& c, torch::nn::Embedding tied);
  torch::Tensor forward(const torch::Tensor& x);  // [B, T, d] -> [B, T, vocab]
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Embedding tok{nullptr};
};
TORCH_MODULE(GptHead);

class GptImpl : public torch::nn::Module {
 public:
  explicit GptImpl(const ModelConfig& c);
  torch::Tensor forward(const torch::Tensor& tokens);  // [B, T] int64 -> logits [B, T, vocab]
  GptEmbedding embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  GptHead head{nullptr};
  torch::Tensor mask;  // buffer: causal, [seq_len, seq_len]
  bool checkpoint_activations = false;  // model.checkpoint_activations: recompute blocks in backward
};
TORCH_MODULE(Gpt);

// Builds the model with deterministic initialization from c.seed (GPT-2 style: normal(0, 0.02)
// weights, zero biases, unit LayerNorm).
Gpt BuildGpt(const ModelConfig& c);

// A module's trainable parameters, each once (LibTorch lists a tied parameter under every module
// holding it; an optimizer given both would update it twice).
std::vector<torch::Tensor> UniqueParameters(const torch::nn::Module& m);

// Mean next-token cross entropy, computed in fp32. logits [B, T, V], targets [B, T].
torch::Tensor LanguageModelLoss(const torch::Tensor& logits, const torch::Tensor& targets);

// Trainable parameters of a model built from `c` (no model is built); the tied head counts once.
int64_t GptParameterCount(const ModelConfig& c);

}  // namespace strata::models
