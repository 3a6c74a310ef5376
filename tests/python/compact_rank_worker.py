"""One rank of test_compact_layouts' rank-count case: trains gpt2 under one compact layout with
every rank fed the same micro-batch (rank 0's), so the all-reduced gradient is each rank's own
exactly ((g + g) / 2 = g) and any difference from one rank comes from how the state is split.
Writes each parameter's full master and moments (DeepSpeed's collective accessors) and the loss
per step to <out>.rank<R>.json."""

import json
import os
import sys

import torch

import harness
import strata
from strata import param_state


def main():
    cfg_path, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    with open(cfg_path, encoding="utf-8") as f:
        spec = json.load(f)
    cfg = spec["config"]
    for section in ("offload_optimizer", "offload_param"):
        sub = cfg["zero_optimization"].get(section, {})
        if "nvme_path" in sub:  # each rank its own swap folder
            sub["nvme_path"] = os.path.join(sub["nvme_path"], f"rank{rank}")
            os.makedirs(sub["nvme_path"], exist_ok=True)
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    engine, _, _, _ = strata.initialize(model=model, model_parameters=model.parameters(),
                                        config=cfg)
    losses = harness.run_steps(engine, "gpt2", 0, spec["steps"])  # rank 0's batches on each rank
    result = {"loss": losses, "master": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in model.named_parameters():
        result["master"][name] = param_state.safe_get_full_fp32_param(p).cpu().flatten().tolist()
        for key in ("exp_avg", "exp_avg_sq"):
            result[key][name] = \
                param_state.safe_get_full_optimizer_state(p, key).cpu().flatten().tolist()
    engine.close()
    with open(f"{out}.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
