"""One rank of test_multirank's failed start: rank 1's start fails after two chunks (a fault
injected through a private binding) and the rank stays alive, as a script that catches the error
would; each rank prints how its start ended, and how a second start on the same ranks ends."""

import os
import sys
import time

import torch

import harness  # noqa: F401 (puts examples/ on the path)
import strata
from strata import _strata

from gpt2_model import GPT2  # noqa: E402

SHAPE = {"vocab_size": 256, "seq_len": 32, "d_model": 128, "n_layers": 2, "n_heads": 4}
CONFIG = {"train_micro_batch_size_per_gpu": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "strata": {"chunk_size": 256 << 10, "comm_timeout_s": 60},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}


def start():
    torch.manual_seed(0)
    t0 = time.monotonic()
    try:
        strata.initialize(model=GPT2(**SHAPE), config=CONFIG)
    except strata.StrataError as e:
        return f"failed after {time.monotonic() - t0:.1f} s: {e}"
    return "started"


def main():
    rank = int(os.environ["RANK"])
    if rank == 1:
        _strata._fail_next_start_after_chunks(2)
    print(f"rank {rank}: {start()}", flush=True)
    print(f"rank {rank}: again: {start()}", flush=True)
    if rank == 1:
        time.sleep(120)  # until the launcher ends the job
    sys.exit(3)


if __name__ == "__main__":
    main()
