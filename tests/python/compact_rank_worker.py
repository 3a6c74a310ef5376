"""One rank of test_compact_layouts' rank-count case: trains gpt2 under one compact layout with
every rank fed the same micro-batch (rank 0's), so the all-reduced gradient is each rank's own
exactly ((g + g) / 2 = g) and any difference from one rank comes from how the state is split.
Writes each parameter's full master and moments (DeepSpeed's collective accessors) and the loss
per step to <out>.rank<R>.json."""

import json
import os
import sys

import harness


def main():
    cfg_path, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    with open(cfg_path, encoding="utf-8") as f:
        spec = json.load(f)
    model, engine = harness.gpt2_on_this_rank(spec["config"], f"rank{rank}")
    losses = harness.run_steps(engine, "gpt2", 0, spec["steps"])  # rank 0's batches on each rank
    result = dict(harness.full_states(model), loss=losses)
    engine.close()
    with open(f"{out}.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
