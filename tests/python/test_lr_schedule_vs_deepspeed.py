"""The config's schedules against real DeepSpeed: tests/data/deepspeed-lr-schedules.json holds
the lr (and beta1) DeepSpeed 0.19.6's own scheduler classes give each optimizer step, recorded in
the peer root by tools/scripts/ds_lr_reference.py; Strata's engine, given the same optimizer and
scheduler sections, must give the same value at every step."""

import json
import os

import pytest
import torch

import strata

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = json.load(open(os.path.join(ROOT, "tests", "data", "deepspeed-lr-schedules.json")))
CASES = DATA["cases"]


def _engine(case):
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": DATA["optimizer"],
           "scheduler": {"type": case["type"], "params": case["params"]},
           "zero_optimization": {"stage": 0}}
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    engine, _, _, _ = strata.initialize(model=model, config=cfg)
    return engine


@pytest.mark.parametrize("case", CASES, ids=[f"{c['type']}-{i}" for i, c in enumerate(CASES)])
def test_schedule_equals_deepspeeds(case):
    engine = _engine(case)
    try:
        for step, (lr, beta1) in enumerate(zip(case["lr"], case["beta1"]), start=1):
            got = engine._cpp.lr_at(step)
            assert got == pytest.approx(lr, rel=1e-9, abs=1e-15), \
                f"{case['type']} {case['params']}: step {step} lr {got}, DeepSpeed {lr}"
            betas = engine._cpp.betas_at(step)
            if case["type"] == "OneCycle":
                assert betas[0] == pytest.approx(beta1, rel=1e-9), f"step {step} beta1"
    finally:
        engine.close()


def test_the_engine_steps_with_that_lr():
    """Not only lr_at: the lr the groups hold at each step follows the same sequence."""
    case = next(c for c in CASES if c["type"] == "WarmupDecayLR")
    engine = _engine(case)
    seen = []
    for _ in range(6):
        seen.append(engine.get_lr()[0])
        loss = engine(torch.ones(1, 2)).sum()
        engine.backward(loss)
        engine.step()
    engine.close()
    assert seen == pytest.approx(case["lr"][:6], rel=1e-9, abs=1e-15)
