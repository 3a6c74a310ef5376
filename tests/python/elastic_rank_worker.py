"""One rank of test_elastic_resume: builds gpt2 under the spec's config on this launch's ranks,
then either trains `steps` global steps and saves (mode "save"), or loads the checkpoint (mode
"load"). Either way it then writes each parameter's full master and moments as they stand
(DeepSpeed's collective accessors), trains `more` global steps and records their losses, to
<out>.rank<R>.json. Run alone (no RANK in the environment) it is one rank of one."""

import json
import os
import sys

import harness


def main():
    spec_path, out = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    cfg = spec["config"]
    model, engine = harness.gpt2_on_this_rank(cfg, f"{spec['mode']}-rank{rank}",
                                              spec.get("freeze", ()),
                                              spec.get("shift_frozen", 0.0))
    accum, micro = cfg["gradient_accumulation_steps"], cfg["train_micro_batch_size_per_gpu"]
    first = spec["steps"]
    if spec["mode"] == "save":
        harness.run_steps(engine, "gpt2", 0, first, accum, rank, world, micro)
        engine.save_checkpoint(spec["checkpoint"])
    else:
        engine.load_checkpoint(spec["checkpoint"])
    result = dict(harness.full_states(model), global_steps=engine.global_steps,
                  loss_scale=engine.optimizer.cur_scale if engine.fp16_enabled() else None)
    result["loss"] = harness.run_steps(engine, "gpt2", first, spec["more"], accum, rank, world,
                                       micro)
    engine.close()
    with open(f"{out}.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
