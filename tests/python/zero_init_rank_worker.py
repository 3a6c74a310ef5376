"""One rank of test_zero_init's two-rank case. Builds a 256 MiB model under zero.Init and records
what this rank holds of it (its proportional memory, its staging file) and what two
GatheredParameters blocks give; then trains gpt2 at stage 3 (NVMe, clipping, accumulation), two
of its weights frozen, from a normal build and from a zero.Init build, each after rank 0 writes
an embedding row through GatheredParameters(modifier_rank=0). Writes the figures and both runs' losses to
<out>.rank<R>.json."""

import copy
import json
import os
import sys

import torch

import harness
import strata
from test_zero_init import Wide, _staging_file_bytes

STEPS = 3


def pss_mib():
    """Anonymous and shared memory, each page counted once however often it is mapped."""
    total = 0
    with open("/proc/self/smaps_rollup", encoding="ascii") as f:
        for line in f:
            if line.startswith(("Pss_Anon:", "Pss_Shmem:")):
                total += int(line.split()[1])
    return total / 1024


def staging_bytes(directory):
    """The bytes the file system holds for this process's open staging file in `directory`, 0
    without one."""
    try:
        return _staging_file_bytes(directory)
    except AssertionError:
        return 0


def train(cfg, rank, world, under_init):
    torch.manual_seed(0)
    if under_init:
        with strata.zero.Init(config_dict_or_path=cfg):
            model = harness.gpt2()
    else:
        model = harness.gpt2()
    # Two weights frozen after the build: the engine keeps them as they are, from rank 0, on
    # every rank (on rank 1 they were windows onto one scratch region).
    for frozen in (model.blocks[0].fc.weight, model.blocks[1].out.weight):
        frozen.requires_grad_(False)
    row = model.embed.tok.weight
    with strata.zero.GatheredParameters([row], modifier_rank=0), torch.no_grad():
        row[3] = 0.25 if rank == 0 else -1.0  # rank 0's write is the one that counts
    engine, _, _, _ = strata.initialize(model=model, config=copy.deepcopy(cfg))
    losses = harness.run_steps(engine, "gpt2", 0, STEPS, cfg["gradient_accumulation_steps"], rank,
                               world)
    with strata.zero.GatheredParameters([row]):
        row3 = row[3].tolist()
    engine.close()
    return losses, row3


def main():
    tmp, out = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result = {}
    wide_dir = os.path.join(tmp, "wide")  # both ranks' staging directory
    os.makedirs(wide_dir, exist_ok=True)
    before = pss_mib()
    with strata.zero.Init(nvme_path=wide_dir) as init:
        wide = Wide()  # its constructor draws every weight again after the Linears made them
    result["pss_growth_mib"] = pss_mib() - before
    result["staging_bytes"] = staging_bytes(wide_dir)
    result["staged_bytes"] = init.staged_bytes
    result["shapes"] = sorted({tuple(p.shape) for p in wide.parameters()})
    with strata.zero.GatheredParameters([wide.layers[3].weight]):
        w = wide.layers[3].weight
        result["gathered_std"] = float(w.std())
        result["gathered_sum"] = float(w.double().sum())
    with strata.zero.GatheredParameters([wide.layers[5].weight], modifier_rank=1), torch.no_grad():
        if rank == 1:
            wide.layers[5].weight.fill_(0.5)
    result["modifier1_mean"] = float(wide.layers[5].weight.double().mean())
    del wide, w
    before = pss_mib()
    plain = Wide()
    result["plain_pss_growth_mib"] = pss_mib() - before
    del plain

    case = {c[0]: c for c in harness.GRID}["stage3_nvme_clip_accum"]
    for name, under_init in (("plain", False), ("init", True)):
        cfg = harness.config_for(case, os.path.join(tmp, name))
        result[name], result[name + "_row3"] = train(cfg, rank, world, under_init)
    with open(f"{out}.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
