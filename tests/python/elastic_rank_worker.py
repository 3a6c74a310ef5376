"""One rank of test_elastic_resume: builds gpt2 under the spec's config on this launch's ranks,
then either trains `steps` global steps and saves (mode "save"), or loads the checkpoint (mode
"load"). Either way it then writes each parameter's full master and moments as they stand
(DeepSpeed's collective accessors), trains `more` global steps and records their losses, to
<out>.rank<R>.json. Run alone (no RANK in the environment) it is one rank of one."""

import json
import os
import sys

import torch

import harness
import strata
from strata import param_state


def main():
    spec_path, out = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    cfg = spec["config"]
    for section in ("offload_optimizer", "offload_param"):
        sub = cfg["zero_optimization"].get(section, {})
        if "nvme_path" in sub:  # each rank its own swap folder
            sub["nvme_path"] = os.path.join(sub["nvme_path"], f"{spec['mode']}-rank{rank}")
            os.makedirs(sub["nvme_path"], exist_ok=True)
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    engine, _, _, _ = strata.initialize(model=model, model_parameters=model.parameters(),
                                        config=cfg)
    accum, micro = cfg["gradient_accumulation_steps"], cfg["train_micro_batch_size_per_gpu"]
    first = spec["steps"]
    if spec["mode"] == "save":
        harness.run_steps(engine, "gpt2", 0, first, accum, rank, world, micro)
        engine.save_checkpoint(spec["checkpoint"])
    else:
        engine.load_checkpoint(spec["checkpoint"])
    result = {"global_steps": engine.global_steps, "master": {}, "exp_avg": {}, "exp_avg_sq": {},
              "loss_scale": engine.optimizer.cur_scale if engine.fp16_enabled() else None}
    for name, p in model.named_parameters():
        result["master"][name] = param_state.safe_get_full_fp32_param(p).cpu().flatten().tolist()
        for key in ("exp_avg", "exp_avg_sq"):
            result[key][name] = \
                param_state.safe_get_full_optimizer_state(p, key).cpu().flatten().tolist()
    result["loss"] = harness.run_steps(engine, "gpt2", first, spec["more"], accum, rank, world,
                                       micro)
    engine.close()
    with open(f"{out}.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
