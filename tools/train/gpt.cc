#include "tools/train/gpt.h"

#include <cmath>
#include <limits>
#include <set>

#include <torch/version.h>

#include "runtime/engine/run_unit.h"
#include "runtime/engine/zero_init.h"
#include "tools/train/parallel_init.h"

namespace strata::models {
namespace {

// A Linear with weights from N(0, 0.02^2) and zero bias. A large one (parallel_init.h) is the
// same stock layer built at 1 x 1, so that its constructor's serial kaiming_uniform_ draws two
// values instead of in x out, then given its shape and filled by ParallelNormal on every core
// (or, under a zero::Init, when the engine reads it).
torch::nn::Linear MakeLinear(int64_t in, int64_t out) {
  torch::NoGradGuard ng;
  if (in * out < kParallelInitMinNumel) {
    torch::nn::Linear l(torch::nn::LinearOptions(in, out));
    l->weight.normal_(0.0, 0.02);
    l->bias.zero_();
    return l;
  }
  torch::nn::Linear l(torch::nn::LinearOptions(1, 1));
  l->options.in_features(in).out_features(out);
  l->bias.set_data(torch::zeros({out}));
  const uint64_t key = DrawInitKey();
  // Under a zero::Init the weight is registered with its draw instead of its values, and the
  // engine draws it as it reads it (Note [generated parameters] in zero_init.cc): the model's
  // largest tensors never go through the staging file.
  if (!zero::StageGenerated(l->weight, {out, in},
                            [key](torch::Tensor w) { ParallelNormal(w, 0.0, 0.02, key); })) {
    l->weight.set_data(torch::empty({out, in}));
    ParallelNormal(l->weight, 0.0, 0.02, key);
  }
  return l;
}

}  // namespace

GptEmbeddingImpl::GptEmbeddingImpl(const ModelConfig& c) {
  pos = register_parameter("pos", torch::empty({c.seq_len, c.d_model}));
  tok = register_module("tok", torch::nn::Embedding(c.vocab_size, c.d_model));
  drop = register_module("drop", torch::nn::Dropout(c.dropout));
  torch::NoGradGuard ng;
  tok->weight.normal_(0.0, 0.02);
  pos.normal_(0.0, 0.02);
}

torch::Tensor GptEmbeddingImpl::forward(const torch::Tensor& tokens) {
  const int64_t t = tokens.size(1);
  TORCH_CHECK(t <= pos.size(0), "sequence of ", t, " tokens is longer than model.seq_len=",
              pos.size(0));
  return drop(tok(tokens) + pos.narrow(0, 0, t));
}

GptBlockImpl::GptBlockImpl(const ModelConfig& c) : n_heads(c.n_heads) {
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
  qkv = register_module("qkv", MakeLinear(c.d_model, 3 * c.d_model));
  proj = register_module("proj", MakeLinear(c.d_model, c.d_model));
  fc = register_module("fc", MakeLinear(c.d_model, 4 * c.d_model));
  out = register_module("out", MakeLinear(4 * c.d_model, c.d_model));
  drop = register_module("drop", torch::nn::Dropout(c.dropout));
}

bool FusedAttentionAvailable() { return TORCH_VERSION_MAJOR >= 2; }

torch::Tensor CausalAttention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& mask, double dropout_p, AttentionPath path) {
  if (path == AttentionPath::kAuto)
    path = FusedAttentionAvailable() ? AttentionPath::kFused : AttentionPath::kExplicit;
  if (path == AttentionPath::kFused) {
#if TORCH_VERSION_MAJOR >= 2
    return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, dropout_p, /*is_causal=*/true);
#else
    TORCH_CHECK(false, "fused attention needs LibTorch 2.x; this build links LibTorch ",
                TORCH_VERSION, " (use the explicit path)");
#endif
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  torch::Tensor att = q.matmul(k.transpose(-2, -1)) * scale;
  att = att.masked_fill(mask.logical_not(), -std::numeric_limits<float>::infinity());
  att = torch::softmax(att, -1);
  if (dropout_p > 0) att = torch::dropout(att, dropout_p, /*train=*/true);
  return att.matmul(v);
}

torch::Tensor GptBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& mask) {
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2), hd = D / n_heads;
  auto parts = qkv(ln1(x)).split(D, -1);
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, n_heads, hd}).transpose(1, 2); };
  torch::Tensor q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
  const double p = is_training() ? drop->options.p() : 0.0;
  torch::Tensor y = CausalAttention(q, k, v, mask, p, attention).transpose(1, 2).contiguous().view({B, T, D});
  torch::Tensor h = x + drop(proj(y));
  return h + drop(out(torch::gelu(fc(ln2(h)))));
}

GptHeadImpl::GptHeadImpl(const ModelConfig& c, torch::nn::Embedding tied) {
  ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
  tok = register_module("tok", std::move(tied));
}

torch::Tensor GptHeadImpl::forward(const torch::Tensor& x) {
  return torch::nn::functional::linear(ln(x), tok->weight);
}

GptImpl::GptImpl(const ModelConfig& c) : checkpoint_activations(c.checkpoint_activations) {
  // Each unit is handed to zero::Partition as soon as it is built: under a zero::Init its
  // parameters go to the staging file at once, so at most one unit is ever in DRAM.
  embed = register_module("embed", GptEmbedding(c));
  zero::Partition(*embed);
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.n_layers; ++i) {
    GptBlock block(c);
    zero::Partition(*block);
    blocks->push_back(block);
  }
  head = register_module("head", GptHead(c, embed->tok));
  zero::Partition(*head);
  mask = register_buffer("mask", torch::ones({c.seq_len, c.seq_len}).tril().to(torch::kBool));
}

torch::Tensor GptImpl::forward(const torch::Tensor& tokens) {
  const int64_t T = tokens.size(1);
  torch::Tensor x = RunUnit(*embed, [&] { return embed->forward(tokens); });
  const torch::Tensor m = mask.narrow(0, 0, T).narrow(1, 0, T);
  for (const auto& b : *blocks) {
    auto* block = b->as<GptBlockImpl>();
    if (checkpoint_activations) {
      x = CheckpointUnit(*block, [block, m](const std::vector<torch::Tensor>& in) {
            return std::vector<torch::Tensor>{block->forward(in[0], m)};
          }, {x})[0];
    } else {
      x = RunUnit(*block, [&] { return block->forward(x, m); });
    }
  }
  return RunUnit(*head, [&] { return head->forward(x); });
}

Gpt BuildGpt(const ModelConfig& c) {
  torch::manual_seed(static_cast<uint64_t>(c.seed));
  return Gpt(c);
}

std::vector<torch::Tensor> UniqueParameters(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& p : m.parameters(/*recurse=*/true))
    if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  return out;
}

torch::Tensor LanguageModelLoss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}).to(torch::kFloat32), targets.reshape({-1}));
}

int64_t GptParameterCount(const ModelConfig& c) {
  const int64_t d = c.d_model, V = c.vocab_size, T = c.seq_len;
  const int64_t block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) +
                        (4 * d * d + d);
  return V * d + T * d + c.n_layers * block + 2 * d;
}

}  // namespace strata::models
