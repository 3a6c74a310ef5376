"""One rank of test_pipe's two-rank cases: a PipelineModule of `stages` stages trained with
train_batch on initialize's loader (DeepSpeed's sampler over the data-parallel groups); writes
the loss train_batch returned per step, and what the engine says of its topology, to
<out>.rank<R>.json."""

import json
import os
import sys

import test_pipe


def main():
    stages, out = int(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    initial = {}
    engine, loader = test_pipe.pipeline_engine(stages, initial)
    losses = [engine.train_batch().item() for _ in range(test_pipe.STEPS)]
    result = {"loss": losses, "dp_world_size": engine.dp_world_size,
              "stage_id": engine.stage_id, "dp_rank": engine.get_data_parallel_rank(),
              "train_batch_size": engine.train_batch_size(), "batches": len(loader.loader),
              "initial": {n: p.flatten().tolist() for n, p in initial.items()}}
    engine.close()
    with open(f"{out}.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
