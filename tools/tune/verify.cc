#include "tools/tune/verify.h"

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "runtime/base/device.h"
#include "runtime/comm/communicator.h"
#include "runtime/engine/engine.h"
#include "tiers/hbm/device_factory.h"
#include "tools/train/gpt.h"

namespace strata::tune {

StatusOr<VerifyResult> VerifyConfig(const Config& config, const std::string& device,
                                    const std::string& nvme_path, int steps) {
  if (steps < 2) return InvalidArgument(StrCat("--verify-steps=", steps, ": must be >= 2 (one is warm-up)"));
  STRATA_ASSIGN_OR_RETURN(auto dev, CreateDevice(device, config.strata.device_memory_budget));
  auto comm = CreateSingleCommunicator();
  EngineOptions eo;
  if (!nvme_path.empty()) eo.nvme_path = {nvme_path};
  STRATA_ASSIGN_OR_RETURN(auto engine,
                          Engine::Create(models::BuildGpt(config.model), config, comm.get(), dev.get(), eo));
  torch::manual_seed(7);
  const int64_t B = config.train_micro_batch_size_per_gpu, T = config.model.seq_len;
  std::map<std::string, std::vector<double>> lanes;
  VerifyResult out;
  for (int s = 0; s < steps; ++s) {
    for (int64_t m = 0; m < config.gradient_accumulation_steps; ++m) {
      torch::Tensor tokens = torch::randint(0, config.model.vocab_size, {B, T + 1}, torch::kLong);
      torch::Tensor logits;
      try {
        logits = engine->Forward(tokens.narrow(1, 0, T));
      } catch (const std::exception& e) {
        return Internal(StrCat("forward failed: ", e.what()));
      }
      torch::Tensor loss = models::LanguageModelLoss(logits, tokens.narrow(1, 1, T));
      STRATA_RETURN_IF_ERROR(engine->Backward(loss));
    }
    STRATA_ASSIGN_OR_RETURN(StepReport rep, engine->Step());
    if (s > 0) {
      const std::pair<const char*, double> measured[] = {
          {"step", rep.step_time_s}, {"compute", rep.compute_s}, {"copy", rep.copy_s},
          {"nvme", rep.nvme_s},      {"optimizer", rep.optimizer_s}, {"comm", rep.comm_s}};
      for (const auto& [lane, t] : measured) lanes[lane].push_back(t);
    }
    out.last_report = rep.ToJson();
  }
  for (auto& [lane, ts] : lanes) {
    std::sort(ts.begin(), ts.end());
    out.lanes[lane] = ts[ts.size() / 2];
  }
  out.step_time_s = out.lanes["step"];
  return out;
}

}  // namespace strata::tune
