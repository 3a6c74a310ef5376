"""One rank of test_compact_layouts' resume-into-other-chunks case: trains gpt2 for 6 steps under
config "into" (the whole run), then 3 steps under config "from" saved to <ckpt>, then loads that
into a run under "into" and trains 3 more; each rank trains its half of every batch. Writes the
losses and every parameter's full master of the whole run and of the resumed one to
<out>.rank<R>.json."""

import copy
import json
import os
import sys

import torch

import harness
import strata
from strata import param_state

STEPS = 6


def train(cfg, rank, world, first, steps, save=None, resume=None):
    cfg = copy.deepcopy(cfg)
    for section in ("offload_optimizer", "offload_param"):
        sub = cfg["zero_optimization"].get(section, {})
        if "nvme_path" in sub:
            sub["nvme_path"] = os.path.join(sub["nvme_path"], f"rank{rank}")
            os.makedirs(sub["nvme_path"], exist_ok=True)
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    engine, *_ = strata.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if resume is not None:
        engine.load_checkpoint(resume)
    losses = harness.run_steps(engine, "gpt2", first, steps, 1, rank, world)
    if save is not None:
        engine.save_checkpoint(save)
    masters = {n: param_state.safe_get_full_fp32_param(p).flatten().tolist()
               for n, p in model.named_parameters()}
    engine.close()
    return losses, masters


def main():
    spec_path, out = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    whole, whole_masters = train(spec["into"], rank, world, 0, STEPS)
    first, _ = train(spec["from"], rank, world, 0, STEPS // 2, save=spec["ckpt"])
    second, masters = train(spec["into"], rank, world, STEPS // 2, STEPS // 2, resume=spec["ckpt"])
    with open(f"{out}.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump({"whole": whole, "whole_masters": whole_masters, "resumed": first + second,
                   "resumed_masters": masters}, f)


if __name__ == "__main__":
    main()
