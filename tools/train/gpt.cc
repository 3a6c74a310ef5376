#include "tools/train/gpt.h"

#include <cmath>

namespace strata::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// Note [saved views]
// torch::nn::Linear computes x.matmul(w.t()) and autograd saves w.t(), a view that shares the
// weight's storage. Under ZeRO-3 that storage is the gathered chunk, so the saved view would keep
// every chunk alive until backward. This function saves the weight parameter itself (a leaf:
// autograd keeps a reference to the variable, not to its current storage), so when the engine
// points the parameter at an empty tensor after forward the chunk is really freed, and backward
// reads whatever the engine gathered for it again.
class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const torch::Tensor& b) {
    ctx->save_for_backward({x, w});
    return torch::addmm(b, x.reshape({-1, x.size(-1)}), w.t())
        .view([&] {
          auto s = x.sizes().vec();
          s.back() = w.size(0);
          return s;
        }());
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    auto saved = ctx->get_saved_variables();
    const torch::Tensor& x = saved[0];
    const torch::Tensor& w = saved[1];
    torch::Tensor g = grads[0].contiguous();
    torch::Tensor g2 = g.reshape({-1, g.size(-1)});
    torch::Tensor gx = g.matmul(w);
    torch::Tensor gw = g2.t().matmul(x.reshape({-1, x.size(-1)}));
    torch::Tensor gb = g2.sum(0);
    return {gx, gw, gb};
  }
};

}  // namespace

StrataLinearImpl::StrataLinearImpl(int64_t in, int64_t out) {
  weight = register_parameter("weight", torch::empty({out, in}));
  bias = register_parameter("bias", torch::zeros({out}));
  torch::NoGradGuard ng;
  weight.normal_(0.0, 0.02);
}

torch::Tensor StrataLinearImpl::forward(const torch::Tensor& x) {
  return LinearFunction::apply(x, weight, bias);
}

GptEmbeddingImpl::GptEmbeddingImpl(const ModelConfig& c) {
  tok = register_module("tok", torch::nn::Embedding(c.vocab_size, c.d_model));
  pos = register_parameter("pos", torch::empty({c.seq_len, c.d_model}));
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
  qkv = register_module("qkv", StrataLinear(c.d_model, 3 * c.d_model));
  proj = register_module("proj", StrataLinear(c.d_model, c.d_model));
  fc = register_module("fc", StrataLinear(c.d_model, 4 * c.d_model));
  out = register_module("out", StrataLinear(4 * c.d_model, c.d_model));
  drop = register_module("drop", torch::nn::Dropout(c.dropout));
  mask = register_buffer("mask", torch::ones({c.seq_len, c.seq_len}).tril().to(torch::kBool));
}

torch::Tensor GptBlockImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2), hd = D / n_heads;
  auto parts = qkv(ln1(x)).split(D, -1);
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, n_heads, hd}).transpose(1, 2); };
  torch::Tensor q = heads(parts[0]), k = heads(parts[1]), v = heads(parts[2]);
  torch::Tensor att = q.matmul(k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
  att = att.masked_fill(mask.narrow(0, 0, T).narrow(1, 0, T).logical_not(),
                        -std::numeric_limits<float>::infinity());
  att = drop(torch::softmax(att, -1));
  torch::Tensor y = att.matmul(v).transpose(1, 2).contiguous().view({B, T, D});
  torch::Tensor h = x + drop(proj(y));
  return h + drop(out(torch::gelu(fc(ln2(h)))));
}

GptHeadImpl::GptHeadImpl(const ModelConfig& c) {
  ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
  lm = register_module("lm", StrataLinear(c.d_model, c.vocab_size));
}

torch::Tensor GptHeadImpl::forward(const torch::Tensor& x) { return lm(ln(x)); }

torch::nn::Sequential BuildGpt(const ModelConfig& c) {
  torch::manual_seed(static_cast<uint64_t>(c.seed));
  torch::nn::Sequential seq;
  seq->push_back(GptEmbedding(c));
  for (int64_t i = 0; i < c.n_layers; ++i) seq->push_back(GptBlock(c));
  seq->push_back(GptHead(c));
  return seq;
}

torch::Tensor LanguageModelLoss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, logits.size(-1)}).to(torch::kFloat32), targets.reshape({-1}));
}

int64_t GptParameterCount(const ModelConfig& c) {
  const int64_t d = c.d_model, V = c.vocab_size, T = c.seq_len;
  const int64_t block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) +
                        (4 * d * d + d);
  return V * d + T * d + c.n_layers * block + 2 * d + d * V + V;
}

}  // namespace strata::models
