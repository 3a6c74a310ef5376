"""An optimizer outside Strata's own set runs itself, on the device, over this rank's partition
(DeepSpeed's zero_allow_untested_optimizer; at stage 0 without it, as with DeepSpeed), and trains
as plain PyTorch with that optimizer does: with parameter groups, a client scheduler, clipping
and accumulation, on one and two ranks. Its state is saved per rank with the checkpoint, and a
resumed run continues bit for bit. Where it cannot run, initialize says why and what to do.
"""

import copy
import os

import pytest
import torch

import harness
import strata
from strata import InvalidArgumentError

STEPS = 5
# (name, stage, offload_param, offload_optimizer, accumulation, clip, keep_live), as harness.GRID
CASES = {
    "stage0": ("stage0", 0, "none", "none", 1, 0.0, True),
    "stage1_clip": ("stage1_clip", 1, "none", "none", 1, 0.5, True),
    "stage2_accum": ("stage2_accum", 2, "none", "none", 2, 0.0, True),
}
# Torch optimizers Strata has no kernel for, with settings that exercise their state.
OPTIMIZERS = {
    "rmsprop": lambda g: torch.optim.RMSprop(g, lr=0.01, alpha=0.9, momentum=0.5,
                                             weight_decay=0.01),
    "adamax": lambda g: torch.optim.Adamax(g, lr=0.02, weight_decay=0.01),
}
LAMBDAS = [lambda s: 1.0 / (1 + s), lambda s: 0.5 ** s]


def groups_of(model, two_groups):
    if not two_groups:
        return model.parameters()
    weights = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": weights}, {"params": rest, "lr": 0.005, "weight_decay": 0.0}]


def reference(make, case, two_groups=False, schedule=False, world=1):
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    opt = make(groups_of(model, two_groups))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, LAMBDAS if two_groups else LAMBDAS[0]) \
        if schedule else None
    return harness.reference_loop("gpt2", model, opt, STEPS, case[4], case[5], world=world,
                                  sched=sched)


def config(case, tmp_path, allow=True):
    cfg = harness.config_for(case, tmp_path / "nvme")
    del cfg["optimizer"]
    if allow:
        cfg["zero_allow_untested_optimizer"] = True
    return cfg


def make_engine(make, cfg, two_groups=False, schedule=False):
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    opt = make(groups_of(model, two_groups))
    kwargs = {}
    if schedule:
        kwargs["lr_scheduler"] = torch.optim.lr_scheduler.LambdaLR(
            opt, LAMBDAS if two_groups else LAMBDAS[0])
    engine, returned, _, _ = strata.initialize(model=model, optimizer=opt,
                                               config=copy.deepcopy(cfg), **kwargs)
    return engine, opt, returned


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_an_untested_optimizer_matches_torch(name, optimizer, tmp_path):
    case = CASES[name]
    engine, opt, _ = make_engine(OPTIMIZERS[optimizer], config(case, tmp_path))
    got = harness.run_steps(engine, "gpt2", 0, STEPS, case[4])
    # The client optimizer really holds state for this rank's partition, on the engine's device.
    assert opt.state, "the client optimizer kept no state"
    assert all(t.device == engine.device for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.ndim > 0)
    engine.close()
    harness.assert_close(got, reference(OPTIMIZERS[optimizer], case))


def test_groups_and_a_client_schedule_drive_the_clients_own_update(tmp_path):
    case = CASES["stage1_clip"]
    make = OPTIMIZERS["rmsprop"]
    engine, opt, returned = make_engine(make, config(case, tmp_path), two_groups=True,
                                        schedule=True)
    got = harness.run_steps(engine, "gpt2", 0, STEPS, case[4])
    # The scheduler moved the client's groups: both groups' lr after STEPS steps.
    assert [g["lr"] for g in opt.param_groups] == pytest.approx(
        [0.01 * LAMBDAS[0](STEPS), 0.005 * LAMBDAS[1](STEPS)])
    assert returned.param_groups is opt.param_groups  # what initialize returned shares them
    engine.close()
    harness.assert_close(got, reference(make, case, two_groups=True, schedule=True))


def test_stage0_runs_any_optimizer_without_the_setting(tmp_path):
    case = CASES["stage0"]
    engine, _, _ = make_engine(OPTIMIZERS["adamax"], config(case, tmp_path, allow=False))
    got = harness.run_steps(engine, "gpt2", 0, STEPS, case[4])
    engine.close()
    harness.assert_close(got, reference(OPTIMIZERS["adamax"], case))


def test_where_it_cannot_run_initialize_says_why(tmp_path):
    make = OPTIMIZERS["rmsprop"]
    with pytest.raises(InvalidArgumentError, match="zero_allow_untested_optimizer"):
        make_engine(make, config(CASES["stage2_accum"], tmp_path, allow=False))
    stage3 = ("stage3", 3, "none", "none", 1, 0.0, True)
    with pytest.raises(InvalidArgumentError, match="zero_optimization.stage 3"):
        make_engine(make, config(stage3, tmp_path))
    offloaded = ("stage2_cpu", 2, "none", "cpu", 1, 0.0, True)
    with pytest.raises(InvalidArgumentError, match="offload_optimizer.device=cpu"):
        make_engine(make, config(offloaded, tmp_path))


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_resumed_run_continues_bit_for_bit(optimizer, tmp_path):
    case = CASES["stage1_clip"]
    make = OPTIMIZERS[optimizer]
    cfg = config(case, tmp_path)
    engine, _, _ = make_engine(make, cfg, schedule=True)
    harness.run_steps(engine, "gpt2", 0, 3, case[4])
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    straight = harness.run_steps(engine, "gpt2", 3, 2, case[4])
    engine.close()
    # A fresh model and optimizer (a new state), then the checkpoint.
    resumed_engine, opt, _ = make_engine(make, cfg, schedule=True)
    path, _ = resumed_engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert path is not None
    assert opt.state, "the client optimizer's state did not come back"
    resumed = harness.run_steps(resumed_engine, "gpt2", 3, 2, case[4])
    resumed_engine.close()
    assert resumed == straight
    # The client file is checked against the manifest: a damaged one is refused by name.
    step_dir = next(d for d in (tmp_path / "ckpt").rglob("rank-00000.client.bin"))
    data = bytearray(step_dir.read_bytes())
    data[len(data) // 2] ^= 0xFF
    step_dir.write_bytes(bytes(data))
    damaged_engine, _, _ = make_engine(make, cfg, schedule=True)
    with pytest.raises(strata.StrataError, match="does not match its manifest"):
        damaged_engine.load_checkpoint(str(tmp_path / "ckpt"))
    damaged_engine.close()


@pytest.mark.skipif(not harness.have_gloo(),
                    reason="this build has no c10d Gloo (its headers were missing at build time)")
def test_two_ranks_step_their_own_partitions_and_match_torch(tmp_path):
    ranks = harness.launch_two_ranks("client_optimizer_worker.py", ["stage2_accum", tmp_path],
                                     tmp_path)
    case = CASES["stage2_accum"]
    got = [(a + b) / 2 for a, b in zip(*ranks)]
    harness.assert_close(got, reference(OPTIMIZERS["rmsprop"], case, world=2))
    assert ranks[0] != ranks[1]  # each rank trained on its own half of the batch


if __name__ == "__main__":
    raise SystemExit(pytest.main([os.path.abspath(__file__)]))
