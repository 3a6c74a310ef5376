"""Records the learning rate (and OneCycle's beta1) that DeepSpeed's own schedulers give each
optimizer step, for tests/python/test_lr_schedule_vs_deepspeed.py. Run it with real DeepSpeed,
e.g. in the peer root ../shared/peers/deepspeed-cpu/setup.sh builds:

    chroot /var/tmp/strata-peer/trixie python3 - < tools/scripts/ds_lr_reference.py \\
        > tests/data/deepspeed-lr-schedules.json

Each case is a DeepSpeed config's "optimizer" and "scheduler" sections; the values are what the
optimizer's param_groups hold when step 1, 2, ... runs, as DeepSpeed's engine drives the
scheduler (built before the first step, stepped after each one)."""

import contextlib
import json
import sys

# DeepSpeed logs to stdout; only the JSON goes there.
with contextlib.redirect_stdout(sys.stderr):
    import deepspeed
    import torch
    from deepspeed.runtime.lr_schedules import (LRRangeTest, OneCycle, WarmupCosineLR,
                                                WarmupDecayLR, WarmupLR)

STEPS = 40
CLASSES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR,
           "WarmupCosineLR": WarmupCosineLR, "OneCycle": OneCycle, "LRRangeTest": LRRangeTest}
CASES = [
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}),
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 10,
                  "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 1,
                  "warmup_type": "linear"}),
    ("WarmupDecayLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 8,
                       "total_num_steps": 30}),
    ("WarmupDecayLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 5,
                       "total_num_steps": 20, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"warmup_min_ratio": 0.0, "warmup_num_steps": 8, "total_num_steps": 30,
                        "cos_min_ratio": 1e-4}),
    ("WarmupCosineLR", {"warmup_min_ratio": 0.1, "warmup_num_steps": 5, "total_num_steps": 25,
                        "cos_min_ratio": 0.05, "warmup_type": "linear"}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 6,
                  "decay_step_size": 3, "decay_lr_rate": 0.5, "decay_mom_rate": 0.1}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 5,
                  "cycle_second_step_size": 7, "cycle_first_stair_count": 2}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 4,
                     "lr_range_test_step_rate": 2.0}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 4,
                     "lr_range_test_step_rate": 2.0, "lr_range_test_staircase": True}),
]
OPTIMIZER_LR = 2e-3


def record(kind, params):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=OPTIMIZER_LR)
    sched = CLASSES[kind](opt, **params)
    lrs, beta1s = [], []
    for _ in range(STEPS):
        lrs.append(opt.param_groups[0]["lr"])
        beta1s.append(opt.param_groups[0]["betas"][0])
        opt.step()
        sched.step()
    return {"lr": lrs, "beta1": beta1s}


with contextlib.redirect_stdout(sys.stderr):
    cases = [dict(type=k, params=p, **record(k, p)) for k, p in CASES]
print(json.dumps({"deepspeed": deepspeed.__version__,
                  "optimizer": {"type": "AdamW", "params": {"lr": OPTIMIZER_LR}},
                  "cases": cases}, indent=1))
