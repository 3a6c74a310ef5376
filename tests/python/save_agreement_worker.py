"""One rank of test_multirank's save-agreement test: each case makes one rank's part of
save_checkpoint fail (or the ranks disagree on the tag) and records, per case, what this rank's
save_checkpoint did: "saved" or the error's type and message. It then saves normally once more,
which must work on both ranks. Writes <out>.rank<R>.json."""

import json
import os
import pickle
import sys
import time

import torch

import strata


class NotPicklable:
    def __reduce__(self):
        raise pickle.PicklingError("this rank's client_state cannot be pickled")


def main():
    root, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = strata.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
    # Rank 0's save_dir/latest cannot be replaced: a folder stands in its place.
    os.makedirs(os.path.join(root, "blocked", "latest", "x"), exist_ok=True)
    cases = {
        "unpicklable": dict(save_dir=os.path.join(root, "a"),
                            client_state={"x": NotPicklable()} if rank == 1 else {}),
        "tag_by_rank": dict(save_dir=os.path.join(root, "b"), tag=f"tag{rank}"),
        "latest_blocked": dict(save_dir=os.path.join(root, "blocked"), tag="t"),
        "dir_by_rank": dict(save_dir=os.path.join(root, f"by-rank-{rank}"), tag="t"),
    }
    result = {}
    for name, kwargs in cases.items():
        start = time.monotonic()
        try:
            engine.save_checkpoint(**kwargs)
            result[name] = "saved"
        except Exception as e:  # noqa: BLE001 - recorded for the test to check
            result[name] = f"{type(e).__name__}: {e}"
        result[name + "_seconds"] = time.monotonic() - start
    engine.save_checkpoint(os.path.join(root, "good"))
    result["good"] = "saved"
    engine.close()
    with open(f"{out}.rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
