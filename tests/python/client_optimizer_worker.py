"""One rank of test_client_optimizer's two-rank case: gpt2 with torch.optim.RMSprop running
itself over this rank's partition (zero_allow_untested_optimizer) under the named case, with the
rank and world size strata-launch set; writes [loss per step] to <out>.rank<R>.json."""

import json
import os
import sys

import harness
from test_client_optimizer import CASES, OPTIMIZERS, STEPS, config, make_engine


def main():
    name, out, tmp = sys.argv[1], sys.argv[2], sys.argv[3]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    case = CASES[name]
    from pathlib import Path
    engine, _, _ = make_engine(OPTIMIZERS["rmsprop"], config(case, Path(tmp) / f"rank{rank}"))
    losses = harness.run_steps(engine, "gpt2", 0, STEPS, case[4], rank, world)
    engine.close()
    with open(f"{out}.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(losses, f)


if __name__ == "__main__":
    main()
