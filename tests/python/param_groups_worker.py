"""One rank of test_param_groups' two-rank case: gpt2 with the decay / no-decay groups given as
model_parameters dicts and a per-group LambdaLR, under the named grid case, with the rank and
world size strata-launch set; writes [loss per step] to <out>.rank<R>.json."""

import copy
import json
import os
import sys

import torch

import harness
import strata
from test_param_groups import LAMBDAS, STEPS, torch_groups


def main():
    name, out, nvme_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    case = {c[0]: c for c in harness.GRID}[name]
    cfg = harness.config_for(case, os.path.join(nvme_dir, f"rank{rank}"))
    cfg["optimizer"]["params"] = {"lr": harness.LR}
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    engine, _, _, _ = strata.initialize(
        model=model, model_parameters=torch_groups(model), config=copy.deepcopy(cfg),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, LAMBDAS))
    losses = harness.run_steps(engine, "gpt2", 0, STEPS, case[4], rank, world)
    engine.close()
    with open(f"{out}.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(losses, f)


if __name__ == "__main__":
    main()
