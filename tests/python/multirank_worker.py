"""One rank of test_multirank: trains `model` under each named grid case with the rank and world
size strata-launch set, and writes {case: [loss per step]} to <out>.rank<R>.json."""

import json
import os
import sys

import harness


def main():
    model_name, cases, steps, out, nvme_dir = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    by_name = {c[0]: c for c in harness.GRID}
    result = {}
    for name in cases:
        case_dir = os.path.join(nvme_dir, name)
        os.makedirs(case_dir, exist_ok=True)
        cfg = harness.config_for(by_name[name], case_dir)
        result[name] = harness.train_strata(model_name, cfg, steps, rank=rank, world=world)
    with open(f"{out}.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
