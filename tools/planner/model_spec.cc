#include "tools/planner/model_spec.h"

#include <algorithm>
#include <limits>

#include "tools/train/parallel_init_threshold.h"

namespace strata::planner {

int64_t ModelSpec::param_count() const {
  int64_t n = 0;
  for (const auto& p : params) n += p.numel;
  return n;
}

int64_t ModelSpec::largest_block_numel() const {
  std::vector<int64_t> per(static_cast<size_t>(num_blocks), 0);
  for (const auto& p : params) per[static_cast<size_t>(p.block)] += p.numel;
  return per.empty() ? 0 : *std::max_element(per.begin(), per.end());
}

StatusOr<ModelSpec> GptModelSpec(const ModelConfig& c) {
  if (c.n_layers < 0 || c.d_model < 1 || c.n_heads < 1 || c.seq_len < 1 || c.vocab_size < 1)
    return InvalidArgument(StrCat("model: n_layers=", c.n_layers, " d_model=", c.d_model,
                                  " n_heads=", c.n_heads, " seq_len=", c.seq_len, " vocab_size=",
                                  c.vocab_size, ": sizes must be >= 1 (n_layers >= 0)"));
  if (c.d_model % c.n_heads != 0)
    return InvalidArgument(StrCat("model.d_model=", c.d_model, " is not divisible by model.n_heads=",
                                  c.n_heads));
  const int64_t d = c.d_model, V = c.vocab_size, T = c.seq_len;
  ModelSpec m;
  m.gpt = c;
  int64_t block = 0;
  auto add = [&](std::string name, int64_t numel) { m.params.push_back({std::move(name), numel, block, {}}); };
  // MakeLinear's large weights (gpt.cc): drawn when the engine reads them, never staged.
  auto add_linear_weight = [&](std::string name, int64_t numel) {
    add(std::move(name), numel);
    m.params.back().generated = numel >= models::kParallelInitMinNumel;
  };
  add("embed.pos", T * d);
  add("embed.tok.weight", V * d);
  const size_t tok = m.params.size() - 1;
  std::vector<std::vector<int64_t>> backward_by_block;
  backward_by_block.push_back({});  // the embedding's parameters arrive last, with the tied head
  for (int64_t l = 0; l < c.n_layers; ++l) {
    ++block;
    const std::string p = StrCat("blocks.", l, ".");
    const int64_t first = static_cast<int64_t>(m.params.size());
    add(p + "ln1.weight", d);
    add(p + "ln1.bias", d);
    add(p + "ln2.weight", d);
    add(p + "ln2.bias", d);
    add_linear_weight(p + "qkv.weight", 3 * d * d);
    add(p + "qkv.bias", 3 * d);
    add_linear_weight(p + "proj.weight", d * d);
    add(p + "proj.bias", d);
    add_linear_weight(p + "fc.weight", 4 * d * d);
    add(p + "fc.bias", 4 * d);
    add_linear_weight(p + "out.weight", 4 * d * d);
    add(p + "out.bias", d);
    // Forward uses ln1, qkv, proj, ln2, fc, out; backward delivers them in reverse, bias first.
    std::vector<int64_t> order;
    for (int64_t k : {11, 10, 9, 8, 3, 2, 7, 6, 5, 4, 1, 0}) order.push_back(first + k);
    backward_by_block.push_back(order);
  }
  ++block;
  add("head.ln.weight", d);
  add("head.ln.bias", d);
  m.params[tok].also_in.push_back(block);  // the head's projection is the token embedding
  backward_by_block.push_back({static_cast<int64_t>(m.params.size()) - 1,
                               static_cast<int64_t>(m.params.size()) - 2});
  backward_by_block[0] = {static_cast<int64_t>(tok), static_cast<int64_t>(tok) - 1};
  for (auto it = backward_by_block.rbegin(); it != backward_by_block.rend(); ++it)
    m.gradient_order.insert(m.gradient_order.end(), it->begin(), it->end());
  m.num_blocks = block + 1;
  return m;
}

StatusOr<ModelSpec> SyntheticModelSpec(int64_t params, int64_t largest_layer) {
  if (params < 1) return InvalidArgument(StrCat("--params=", params, ": must be >= 1"));
  if (largest_layer < 1 || largest_layer > params)
    return InvalidArgument(StrCat("--largest-layer=", largest_layer, ": must be in 1..--params (",
                                  params, ")"));
  // One block per layer: a count no real model has would only fill memory (10^12 for
  // --params 1e12 --largest-layer 1). A million layers is far past any model's.
  constexpr int64_t kMaxLayers = 1000000;
  const int64_t layers = params / largest_layer + (params % largest_layer != 0);
  if (layers > kMaxLayers)
    return InvalidArgument(StrCat(
        "--params=", params, " in layers of --largest-layer=", largest_layer, " is ", layers,
        " layers, more than the ", kMaxLayers, " modelled; give the largest layer's real size"));
  ModelSpec m;
  int64_t left = params, block = 0;
  while (left > 0) {
    const int64_t n = std::min(left, largest_layer);
    m.params.push_back({StrCat("layer", block), n, block, {}});
    left -= n;
    ++block;
  }
  m.num_blocks = block;
  return m;
}

// Note [activation count]
// What autograd saves in GptBlockImpl::forward (tools/train/gpt.cc), per sequence of T tokens
// with d = d_model, h = n_heads, e = activation bytes:
//   ln1: input x (T·d·e) + mean, rstd (2·T·4)        qkv (Linear): input (T·d·e); the
//                                                    weight it saves is a view of the parameter
//                                                    (no new memory)
//   q/k/v: views of the qkv output, saved by the two matmuls: 3·T·d·e
//   softmax: its output (h·T·T·e), also saved by att·v   proj: input y (T·d·e)
//   ln2: input h (T·d·e) + stats (2·T·4)              fc: input (T·d·e)
//   gelu: input (4·T·d·e)                              out: input = gelu output (4·T·d·e)
//   => 16·T·d·e + h·T·T·e + 16·T bytes, plus with dropout > 0 one byte per element of the
//      attention probabilities and of the two residual branches (h·T·T + 2·T·d).
// Head: ln input + stats, lm input (2·T·d·e + 8·T); the logits (T·V·e) are kept by the caller
// for the loss, which casts them to fp32 and saves log_softmax's fp32 output (T·V·4; in an fp32
// run the cast is the logits themselves).
// Embedding: the token ids (T·8).
//
// Note [checkpointed activations]
// With model.checkpoint_activations each block runs under CheckpointUnit (runtime/engine/
// run_unit.cc): forward records nothing inside the block and keeps only its input x (B·T·d·e;
// block i's output is block i+1's input, one tensor). Backward reruns one block at a time with
// autograd on, so at its peak the device holds every block's kept input, one block's full
// activations as counted above, and the gradient arriving at that block's output (B·T·d·e).
// Forward's peak (one block's working set without autograd) is below that.
ActivationEstimate GptActivations(const ModelConfig& c, int64_t micro_batch, int elem_size,
                                  bool inputs_on_host) {
  // In long double (a 64-bit mantissa: exact wherever the result fits in uint64_t) and saturated
  // at its largest value: a config of extreme sizes wrapped around, and its activations shrank
  // as the micro-batch grew.
  using F = long double;
  const auto bytes = [](F v) {
    constexpr F kMax = static_cast<F>(std::numeric_limits<uint64_t>::max());
    return v >= kMax ? std::numeric_limits<uint64_t>::max() : static_cast<uint64_t>(v);
  };
  const F B = static_cast<F>(std::max<int64_t>(micro_batch, 0));
  const F T = static_cast<F>(c.seq_len), d = static_cast<F>(c.d_model),
          h = static_cast<F>(c.n_heads), V = static_cast<F>(c.vocab_size),
          e = static_cast<F>(elem_size);
  ActivationEstimate a;
  F block = 16 * T * d * e + h * T * T * e + 16 * T;
  if (c.dropout > 0) block += h * T * T + 2 * T * d;
  a.per_block_bytes = bytes(B * block);
  // fp32 logits are their own fp32 copy (.to(kFloat32) returns the same tensor).
  const F head = B * (2 * T * d * e + 8 * T + T * V * e + (elem_size == 4 ? 0 : T * V * 4));
  a.head_bytes = bytes(head);
  const F L = static_cast<F>(c.n_layers), ids = B * T * 8;
  if (!c.checkpoint_activations) {
    a.saved_bytes = bytes(B * block * L + head + ids);
    return a;
  }
  a.checkpointed = true;
  const F kept = B * T * d * e * L;
  a.kept_inputs_bytes = bytes(kept);
  a.saved_bytes = bytes((inputs_on_host ? 0 : kept) + B * block + B * T * d * e + head + ids);
  return a;
}

double GptFlopsPerMicroBatch(const ModelConfig& c, int64_t micro_batch) {
  const double tokens = static_cast<double>(micro_batch) * static_cast<double>(c.seq_len);
  // Parameters that take part in matmuls (the embedding table is a lookup, not a matmul).
  const double d = static_cast<double>(c.d_model);
  const double matmul_params =
      static_cast<double>(c.n_layers) * 12.0 * d * d + d * static_cast<double>(c.vocab_size);
  const double attention = 12.0 * static_cast<double>(c.n_layers) * static_cast<double>(c.seq_len) *
                           static_cast<double>(c.seq_len) * d * static_cast<double>(micro_batch);
  return 6.0 * matmul_params * tokens + attention;
}

}  // namespace strata::planner
