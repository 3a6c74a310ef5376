"""One rank of test_param_state's two-rank case: trains gpt2 for STEPS steps on its half of each
batch, then writes to <out>.rank<R>.json what DeepSpeed's per-parameter accessors give on this
rank: every parameter's full fp32 master and Adam moments (collective), its local shards, and
the full value after a safe_set_full_fp32_param every rank makes with the same tensor."""

import json
import os
import sys

import torch

import harness
import strata
from strata import param_state

STEPS = 2


def main():
    case_name, out, nvme_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    case = {c[0]: c for c in harness.GRID}[case_name]
    case = (case[0], case[1], case[2], case[3], 1, 0.0, case[6])  # the whole-batch reference
    cfg = harness.config_for(case, os.path.join(nvme_dir, f"rank{rank}"))
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    engine, _, _, _ = strata.initialize(model=model, model_parameters=model.parameters(),
                                        config=cfg)
    harness.run_steps(engine, "gpt2", 0, STEPS, 1, rank, world)
    params = dict(model.named_parameters())
    result = {"full": {}, "exp_avg": {}, "exp_avg_sq": {}, "local": {}, "ds_tensor": {}}
    masters = dict(zip(params, engine.master_parameters()))
    for name, p in params.items():
        full = param_state.safe_get_full_fp32_param(p).cpu()
        assert torch.equal(full, masters[name]), name
        result["full"][name] = full.flatten().tolist()
        for key in ("exp_avg", "exp_avg_sq"):
            result[key][name] = param_state.safe_get_full_optimizer_state(p, key).cpu().flatten().tolist()
        result["local"][name] = param_state.safe_get_local_fp32_param(p).cpu().tolist()
        if hasattr(p, "ds_tensor"):
            result["ds_tensor"][name] = p.ds_tensor.float().cpu().tolist()
    name = "blocks.0.fc.weight"
    shape = getattr(params[name], "ds_shape", params[name].shape)  # stage 3: may be empty now
    value = torch.linspace(-1, 1, shape.numel()).view(shape)
    param_state.safe_set_full_fp32_param(params[name], value)
    result["after_set"] = param_state.safe_get_full_fp32_param(params[name]).cpu().flatten().tolist()
    with strata.zero.GatheredParameters([params[name]]):
        result["gathered_after_set"] = params[name].detach().float().cpu().flatten().tolist()
    engine.close()
    with open(f"{out}.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
