#include "tools/tune/calibrate.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <vector>

#include "tools/planner/model_spec.h"
#include "tools/train/gpt.h"

namespace strata::tune {

int ComputeThreads() { return torch::get_num_threads(); }

namespace {

// The engine's rule for the compute dtype (runtime/engine/compute_dtype.cc), as a torch dtype.
torch::Dtype ComputeDtype(const Config& c) {
  if (c.bf16.enabled) return torch::kBFloat16;
  if (c.fp16.enabled) return torch::kFloat16;
  return torch::kFloat32;
}

// One forward + loss + backward of `model` on `tokens`, in seconds.
double Pass(models::Gpt& model, const torch::Tensor& tokens, int64_t T) {
  const auto t0 = std::chrono::steady_clock::now();
  torch::Tensor logits = model->forward(tokens.narrow(1, 0, T));
  torch::Tensor loss = models::LanguageModelLoss(logits, tokens.narrow(1, 1, T));
  loss.backward();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // The engine frees gradients after handing them off; do the same so passes do not accumulate.
  for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
  return s;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

void Extrapolate(double one_layer_s, double two_layer_s, int64_t n_layers, ComputeCalibration* c) {
  c->one_layer_s = one_layer_s;
  c->two_layer_s = two_layer_s;
  if (two_layer_s > one_layer_s) {
    c->block_s = two_layer_s - one_layer_s;
    c->rest_s = std::max(0.0, one_layer_s - c->block_s);
    c->micro_batch_s = c->rest_s + static_cast<double>(n_layers) * c->block_s;
  } else {
    c->block_s = 0;
    c->rest_s = one_layer_s;
    c->micro_batch_s = one_layer_s;
  }
}

uint64_t CalibrationBytes(const Config& config, int64_t n_layers) {
  ModelConfig m = config.model;
  m.n_layers = n_layers;
  const double params = static_cast<double>(models::GptParameterCount(m));
  const double B = static_cast<double>(config.train_micro_batch_size_per_gpu);
  const double T = static_cast<double>(config.model.seq_len);
  const double d = static_cast<double>(config.model.d_model);
  const double H = static_cast<double>(config.model.n_heads);
  const double V = static_cast<double>(config.model.vocab_size);
  // Generous per-block activation count: ~34 values of width d per token (norms, qkv, attention
  // output, the 4d MLP and their gradients) and ~5 per attention score (scores, mask, softmax,
  // its gradient); the head keeps logits, their fp32 copy and gradient.
  const double acts =
      static_cast<double>(n_layers) * (B * T * d * 34 + B * H * T * T * 5) + B * T * V * 3;
  return static_cast<uint64_t>(params * 4 * 2 + acts * 4);
}

StatusOr<ComputeCalibration> CalibrateCompute(const Config& config, int reps,
                                              uint64_t whole_model_limit) {
  if (reps < 1)
    return InvalidArgument(StrCat("calibration needs at least one timed pass, got ", reps));
  const ModelConfig& mc = config.model;
  const int64_t B = config.train_micro_batch_size_per_gpu, T = mc.seq_len;
  try {
    const torch::Dtype dt = ComputeDtype(config);
    torch::manual_seed(static_cast<uint64_t>(mc.seed));
    const torch::Tensor tokens = torch::randint(0, mc.vocab_size, {B, T + 1}, torch::kLong);
    // Each model runs its passes back to back after a warm-up pass (LibTorch's thread pool,
    // allocator and BLAS packing), as the engine runs one model step after step. Interleaving
    // two models was tried: the allocator then keeps returning and refaulting the other model's
    // activation sizes, and the 2-block copy measured ~20 % slow on the tiny config.
    auto timed = [&](int64_t n_layers) {
      ModelConfig m = mc;
      m.n_layers = n_layers;
      models::Gpt model = models::BuildGpt(m);
      model->to(dt);
      model->train();
      Pass(model, tokens, T);
      std::vector<double> t;
      for (int r = 0; r < reps; ++r) t.push_back(Pass(model, tokens, T));
      return Median(t);
    };
    ComputeCalibration c;
    if (CalibrationBytes(config, mc.n_layers) <= whole_model_limit) {
      c.whole_model = true;
      c.micro_batch_s = timed(mc.n_layers);
    } else {
      const double t1 = timed(1);
      const double t2 = timed(2);
      Extrapolate(t1, t2, mc.n_layers, &c);
    }
    c.flops = planner::GptFlopsPerMicroBatch(mc, B);
    if (!(c.micro_batch_s > 0)) return Internal("calibration measured a zero-length pass");
    c.gflops = c.flops / c.micro_batch_s / 1e9;
    return c;
  } catch (const std::exception& e) {
    return FailedPrecondition(
        StrCat("could not run the model on the CPU for calibration: ", e.what()));
  }
}

}  // namespace strata::tune
