"""One rank of test_writable_gathers' two-rank case: trains gpt2 at stage 3 with NVMe-resident
states, writes a rank-dependent change through GatheredParameters(modifier_rank=argv[1]) after
BEFORE steps, trains AFTER more, and writes {"losses": [...], "row3": [...]} (the embedding row
every rank holds after the write) to <out>.rank<R>.json."""

import json
import os
import sys

import torch

import harness
import strata
from test_writable_gathers import AFTER, BEFORE, edit, edited_params


def main():
    modifier, out, nvme_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    case = {c[0]: c for c in harness.GRID}["stage3_nvme_clip_accum"]
    # No clipping or accumulation here: the reference is the plain whole-batch loop.
    case = (case[0], case[1], case[2], case[3], 1, 0.0, case[6])
    cfg = harness.config_for(case, os.path.join(nvme_dir, f"rank{rank}"))
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    engine, _, _, _ = strata.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = harness.run_steps(engine, "gpt2", 0, BEFORE, 1, rank, world)
    with strata.zero.GatheredParameters(edited_params(model), modifier_rank=modifier):
        edit(model, rank)  # each rank writes its own values; the modifier's must win
    with strata.zero.GatheredParameters([model.embed.tok.weight]):
        row3 = model.embed.tok.weight[3].tolist()
    losses += harness.run_steps(engine, "gpt2", BEFORE, AFTER, 1, rank, world)
    engine.close()
    with open(f"{out}.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump({"losses": losses, "row3": row3}, f)


if __name__ == "__main__":
    main()
