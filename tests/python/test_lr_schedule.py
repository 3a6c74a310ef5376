"""The lr comes from the optimizer's param_groups at every step: a client LR scheduler given to
initialize (object or callable), a scheduler the loop steps on its own torch optimizer (Hugging
Face's Trainer without a DeepSpeed scheduler), and a loop that writes the lr by hand all train
as plain PyTorch does with the same schedule. The optimizer initialize returns is a
torch.optim.Optimizer whose state_dict round-trips, and a checkpoint carries the schedule.
"""

import copy
import math

import pytest
import torch

import harness
import strata
from strata import InvalidArgumentError

STEPS = 6
CASES = {c[0]: c for c in harness.GRID}


def warmup_then_decay(step):
    """The Trainer's default shape: linear warmup over 2 steps, then linear decay."""
    if step < 2:
        return (step + 1) / 2
    return max(0.0, (STEPS + 1 - step) / (STEPS - 1))


def lambda_schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_decay)


def reference(accum, clip, set_lr_by_hand=False, make_sched=lambda_schedule):
    """Plain PyTorch: AdamW stepped by a scheduler (or the LambdaLR's lr written by hand)."""
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    opt = torch.optim.AdamW(model.parameters(), lr=harness.LR, weight_decay=harness.WEIGHT_DECAY)

    def set_lr(step):
        for g in opt.param_groups:
            g["lr"] = harness.LR * warmup_then_decay(step)

    return harness.reference_loop("gpt2", model, opt, STEPS, accum, clip,
                                  sched=None if set_lr_by_hand else make_sched(opt),
                                  before_step=set_lr if set_lr_by_hand else None)


def strata_engine(case, tmp_path, **kwargs):
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    cfg = harness.config_for(case, tmp_path / "nvme")
    if kwargs.get("optimizer") is not None:
        kwargs["optimizer"] = kwargs["optimizer"](model)
    engine, opt, _, sched = strata.initialize(model=model, model_parameters=model.parameters(),
                                              config=copy.deepcopy(cfg), **kwargs)
    return engine, opt, sched, case[4]


def train(engine, accum, first, count, before_step=None, after_step=None):
    losses = []
    for step in range(first, first + count):
        if before_step:
            before_step(step)
        total = 0.0
        for m in range(accum):
            x, y = harness.batch("gpt2", step * accum + m)
            loss = harness.loss_of("gpt2", engine, x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item() / accum
        if after_step:
            after_step(step)
        losses.append(total)
    return losses


# Overlapped updates start in backward (stage 0/3 without clipping); clipping and accumulation
# fix the lr at step(); cpu and nvme offload; stage 3 releasing every unit.
SCHEDULE_CASES = ["stage0", "stage2_cpu_clip", "stage3_cpu_release", "stage3_nvme_clip_accum"]


@pytest.mark.parametrize("name", SCHEDULE_CASES)
def test_a_client_scheduler_callable_matches_pytorch(name, tmp_path):
    case = CASES[name]
    engine, opt, sched, accum = strata_engine(
        case, tmp_path,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, warmup_then_decay))
    assert isinstance(opt, torch.optim.Optimizer)
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR) and sched.optimizer is opt
    got = train(engine, accum, 0, STEPS)
    harness.assert_close(got, reference(accum, case[5]))
    # The schedule really moved: the lr after the last step is the lambda's, not the config's.
    assert engine.get_lr() == [pytest.approx(harness.LR * warmup_then_decay(STEPS))]
    engine.close()


def test_a_scheduler_object_on_the_client_optimizer_matches_pytorch(tmp_path):
    case = CASES["stage3"]
    client = {}

    def make(model):
        client["opt"] = torch.optim.AdamW(model.parameters(), lr=harness.LR,
                                          weight_decay=harness.WEIGHT_DECAY)
        client["sched"] = torch.optim.lr_scheduler.LambdaLR(client["opt"], warmup_then_decay)
        return client["opt"]

    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    opt = make(model)
    engine, _, _, sched = strata.initialize(
        model=model, optimizer=opt, lr_scheduler=client["sched"],
        config=copy.deepcopy(harness.config_for(case, tmp_path / "nvme")))
    assert sched is client["sched"]
    harness.assert_close(train(engine, 1, 0, STEPS), reference(1, 0.0))
    engine.close()


def test_the_trainers_own_scheduler_on_the_client_optimizer_drives_the_lr(tmp_path):
    # Hugging Face's Trainer with neither a DeepSpeed optimizer nor scheduler: it passes its
    # AdamW to initialize and steps its LambdaLR on that AdamW itself, after engine.step().
    case = CASES["stage3_cpu_release"]
    made = {}

    def make(model):
        made["opt"] = torch.optim.AdamW(model.parameters(), lr=harness.LR,
                                        weight_decay=harness.WEIGHT_DECAY)
        return made["opt"]

    engine, _, sched, accum = strata_engine(case, tmp_path, optimizer=make)
    assert sched is None
    trainer_sched = torch.optim.lr_scheduler.LambdaLR(made["opt"], warmup_then_decay)
    got = train(engine, accum, 0, STEPS, after_step=lambda _: trainer_sched.step())
    harness.assert_close(got, reference(accum, case[5]))
    engine.close()


def test_a_loop_that_writes_the_lr_by_hand_matches_pytorch(tmp_path):
    case = CASES["stage2_cpu_clip"]
    engine, opt, _, accum = strata_engine(case, tmp_path)

    def set_lr(step):
        for g in opt.param_groups:
            g["lr"] = harness.LR * warmup_then_decay(step)

    got = train(engine, accum, 0, STEPS, before_step=set_lr)
    harness.assert_close(got, reference(accum, case[5], set_lr_by_hand=True))
    engine.close()


def test_the_configs_schedule_writes_its_lr_into_the_groups(tmp_path):
    case = CASES["stage0"]
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    cfg = harness.config_for(case, tmp_path / "nvme",
                             scheduler={"type": "WarmupLR",
                                        "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                   "warmup_num_steps": 4, "warmup_type": "linear"}})
    engine, opt, _, sched = strata.initialize(model=model, config=cfg)
    seen = []
    for step in range(5):
        seen.append(opt.param_groups[0]["lr"])
        assert sched.get_last_lr() == [seen[-1]]
        train(engine, 1, step, 1)
    # DeepSpeed's linear WarmupLR: min + (max - min) * it / warmup_num_steps, where step s runs
    # with iteration s - 2 (the scheduler writes min when built and steps after each step), as
    # real DeepSpeed 0.19.6 gives (test_lr_schedule_vs_deepspeed.py).
    assert seen == pytest.approx([0.0, 0.0, 2.5e-4, 5e-4, 7.5e-4])
    engine.close()


def test_warmup_cosine_scales_each_groups_own_lr(tmp_path):
    """DeepSpeed's WarmupCosineLR multiplies each group's own lr by its ratio (the other
    schedules write one lr into every group); every group took the config's lr here, so a
    second group at a tenth of it trained ten times too fast. The groups train as plain
    PyTorch does with those lrs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    ref = copy.deepcopy(model)
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
           "scheduler": {"type": "WarmupCosineLR",
                         "params": {"warmup_min_ratio": 0.5, "warmup_num_steps": 2,
                                    "total_num_steps": 8, "warmup_type": "linear"}}}
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 1e-4}]
    engine, opt, _, _ = strata.initialize(model=model, model_parameters=groups, config=cfg)
    ref_opt = torch.optim.AdamW([{"params": ref[0].parameters()},
                                 {"params": ref[1].parameters(), "lr": 1e-4}],
                                lr=1e-3, weight_decay=0.0)
    x = torch.randn(6, 1, 4, generator=torch.Generator().manual_seed(3))
    for step in range(6):
        lrs = [g["lr"] for g in opt.param_groups]
        # The ratio from DeepSpeed's formula (iteration step - 2; warmup min 0.5 over 2 steps,
        # then a cosine down to cos_min_ratio 0.0001 at step 8).
        it = step - 1
        if it < 0:
            ratio = 0.0
        elif it < 2:
            ratio = 0.5 + 0.5 * it / 2
        else:
            cosine = (1 + math.cos(math.pi * min(1.0, (it - 2 + 1) / 6))) / 2
            ratio = max(0.0, 0.0001 + (1 - 0.0001) * cosine)
        assert lrs == pytest.approx([1e-3 * ratio, 1e-4 * ratio], rel=1e-12, abs=1e-18), step
        for g, lr in zip(ref_opt.param_groups, lrs):
            g["lr"] = lr
        engine.backward(engine(x[step]).square().sum())
        engine.step()
        ref(x[step]).square().sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(engine.master_parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q.detach(), rtol=1e-6, atol=1e-7)
    engine.close()


def one_cycle(opt):
    # cycle_momentum (the default) moves Adam's betas[0] every step, as well as the lr.
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=STEPS + 1)


@pytest.mark.parametrize("name", ["stage0", "stage3_nvme_clip_accum"])
def test_a_schedule_that_also_moves_betas_matches_pytorch(name, tmp_path):
    case = CASES[name]
    engine, opt, _, accum = strata_engine(case, tmp_path, lr_scheduler=one_cycle)
    got = train(engine, accum, 0, STEPS)
    harness.assert_close(got, reference(accum, case[5], make_sched=one_cycle))
    assert opt.param_groups[0]["betas"][0] != 0.9  # the schedule did move it
    engine.close()


class DeepSpeedStyleSchedule:
    """DeepSpeed's OneCycle and LRRangeTest restated from their documentation, as a scheduler for
    the plain-PyTorch reference: the constructor writes the first step's lr (and OneCycle's
    (cycle_min_mom, 0.99) betas); step() after each optimizer step advances the batch index b
    and writes the values for index b."""

    def __init__(self, opt, kind, p):
        self.opt, self.kind, self.p, self.last = opt, kind, p, -1
        self._write(0)

    def _scale(self, b):
        p = self.p
        first = p["cycle_first_step_size"]
        second = p.get("cycle_second_step_size", first)
        total = first + second
        x = 1 + b / total - math.floor(1 + b / total)
        up = x <= first / total
        scale = x / (first / total) if up else (x - 1) / (first / total - 1)
        stairs = p.get("cycle_first_stair_count", 0) if up else p.get("cycle_second_stair_count", 0)
        if stairs > 0:
            at = b % total
            pos = at * stairs / first if at <= first else (total - at) * stairs / second
            scale = math.floor(pos) / stairs
        return scale, total

    def _write(self, b):
        p = self.p
        betas = None
        if self.kind == "LRRangeTest":
            k = b / p["lr_range_test_step_size"]
            lr = p["lr_range_test_min_lr"] * (1 + p["lr_range_test_step_rate"] * k)
        else:
            scale, total = self._scale(b)
            if b == 0:
                lr, betas = p["cycle_min_lr"], (p["cycle_min_mom"], 0.99)
            elif b - 1 < total:
                lr = p["cycle_min_lr"] + (p["cycle_max_lr"] - p["cycle_min_lr"]) * scale
                betas = (p["cycle_max_mom"] - (p["cycle_max_mom"] - p["cycle_min_mom"]) * scale, 0.99)
            else:
                k = (b - total) / p["decay_step_size"]
                lr = p["cycle_min_lr"] / (1 + p["decay_lr_rate"] * k)
                betas = (p["cycle_max_mom"] * (1 + p["decay_mom_rate"] * k), 0.99)
        for g in self.opt.param_groups:
            g["lr"] = lr
            if betas is not None:
                g["betas"] = betas

    def step(self):
        self.last += 1
        self._write(self.last + 1)


CONFIG_SCHEDULES = {
    # A short cycle with stairs on the way down, then decay of both lr and momentum.
    "one_cycle": ("OneCycle", {"cycle_min_lr": 2e-4, "cycle_max_lr": 2e-3, "cycle_first_step_size": 2,
                               "cycle_second_step_size": 3, "cycle_second_stair_count": 2,
                               "decay_step_size": 1, "decay_lr_rate": 0.5, "cycle_min_mom": 0.85,
                               "cycle_max_mom": 0.95, "decay_mom_rate": 0.01}),
    "lr_range_test": ("LRRangeTest", {"lr_range_test_min_lr": 2e-4, "lr_range_test_step_size": 2,
                                      "lr_range_test_step_rate": 1.5}),
}


@pytest.mark.parametrize("schedule", sorted(CONFIG_SCHEDULES))
@pytest.mark.parametrize("name", ["stage0", "stage3_nvme_clip_accum"])
def test_the_configs_one_cycle_and_range_test_match_deepspeeds_rule(schedule, name, tmp_path):
    kind, params = CONFIG_SCHEDULES[schedule]
    case = CASES[name]
    steps = 8  # past the 5-step cycle: the decay phase runs too
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    cfg = harness.config_for(case, tmp_path / "nvme", scheduler={"type": kind, "params": params})
    engine, opt, _, _ = strata.initialize(model=model, config=copy.deepcopy(cfg))
    seen = []
    got = []
    for step in range(steps):
        seen.append((opt.param_groups[0]["lr"], tuple(opt.param_groups[0]["betas"])))
        got += train(engine, case[4], step, 1)
    engine.close()

    torch.manual_seed(0)
    ref_model = harness.MODELS["gpt2"]()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=harness.LR,
                                weight_decay=harness.WEIGHT_DECAY)
    ref_sched = DeepSpeedStyleSchedule(ref_opt, kind, params)
    want_seen = []
    want = harness.reference_loop(
        "gpt2", ref_model, ref_opt, steps, case[4], case[5], sched=ref_sched,
        before_step=lambda _: want_seen.append((ref_opt.param_groups[0]["lr"],
                                                tuple(ref_opt.param_groups[0]["betas"]))))
    assert [s[0] for s in seen] == pytest.approx([w[0] for w in want_seen], rel=1e-12)
    assert [s[1] for s in seen] == [pytest.approx(w[1], rel=1e-12) for w in want_seen]
    if kind == "OneCycle":
        assert len({s[1][0] for s in seen}) > 3  # beta1 really cycled
    harness.assert_close(got, want)


def test_a_one_cycle_momentum_decay_past_one_is_refused_naming_the_schedule(tmp_path):
    """OneCycle's decay_mom_rate grows betas[0] after the cycle without bound, as DeepSpeed's
    does. The step it reached 1 at was refused as "parameter group 0: betas[0]=1.045 must be in
    [0, 1)", naming nothing the config holds; the refusal now names the schedule's keys. The
    steps before it train, and the engine's weights stay finite."""
    params = {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 2,
              "cycle_second_step_size": 2, "decay_step_size": 1, "cycle_min_mom": 0.85,
              "cycle_max_mom": 0.95, "decay_mom_rate": 0.1}
    cfg = harness.config_for(CASES["stage2_cpu_clip"], tmp_path / "nvme",
                             scheduler={"type": "OneCycle", "params": params})
    torch.manual_seed(0)
    engine, *_ = strata.initialize(model=harness.MODELS["gpt2"](), config=cfg)
    train(engine, 1, 0, 5)
    with pytest.raises(InvalidArgumentError, match=r"scheduler OneCycle: .*decay_mom_rate 0\.1 per "
                                                   r"decay_step_size 1 .*betas\[0\] to 1\.045 at "
                                                   r"step 6.*cycle_momentum to false"):
        train(engine, 1, 5, 1)
    assert engine.global_steps == 5
    assert all(torch.isfinite(p).all() for p in engine.master_parameters())
    engine.close()


def test_groups_added_after_initialize_are_refused_by_name(tmp_path):
    engine, opt, _, _ = strata_engine(CASES["stage0"], tmp_path)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    x, y = harness.batch("gpt2", 0)
    with pytest.raises(InvalidArgumentError, match="groups cannot be added after initialize"):
        engine.backward(harness.loss_of("gpt2", engine, x, y))
    engine.close()


def test_the_optimizers_state_dict_round_trips_its_hyperparameters(tmp_path):
    engine, opt, _, _ = strata_engine(CASES["stage3"], tmp_path)
    opt.param_groups[0]["lr"] = 3e-4
    sd = opt.state_dict()
    assert sd["state"] == {} and sd["param_groups"][0]["lr"] == 3e-4
    assert sd["param_groups"][0]["params"] == list(range(len(opt.param_groups[0]["params"])))
    opt.param_groups[0]["lr"] = 1.0
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 3e-4
    with pytest.raises(InvalidArgumentError, match="per-parameter state"):
        opt.load_state_dict({"state": {0: {"exp_avg": torch.zeros(1)}},
                             "param_groups": sd["param_groups"]})
    with pytest.raises(InvalidArgumentError, match="do not match"):
        opt.load_state_dict({"state": {}, "param_groups": sd["param_groups"] * 2})
    engine.close()


@pytest.mark.parametrize("name", ["stage0", "stage3_nvme_clip_accum"])
def test_a_checkpoint_carries_the_client_schedule_bit_exactly(name, tmp_path):
    case = CASES[name]
    make_sched = lambda o: torch.optim.lr_scheduler.LambdaLR(o, warmup_then_decay)  # noqa: E731
    engine, _, _, accum = strata_engine(case, tmp_path, lr_scheduler=make_sched)
    train(engine, accum, 0, 3)
    engine.save_checkpoint(tmp_path / "ckpt", client_state={"mine": 7})
    straight = train(engine, accum, 3, 3)
    engine.close()

    resumed, _, sched, _ = strata_engine(case, tmp_path, lr_scheduler=make_sched)
    path, client_state = resumed.load_checkpoint(tmp_path / "ckpt")
    assert path is not None and client_state == {"mine": 7}
    assert sched.last_epoch == 3
    assert resumed.get_lr() == [harness.LR * warmup_then_decay(3)]
    assert train(resumed, accum, 3, 3) == straight
    resumed.close()


def test_an_lr_that_is_not_finite_or_is_negative_is_refused(tmp_path):
    engine, opt, _, _ = strata_engine(CASES["stage0"], tmp_path)
    for bad in (float("nan"), float("inf"), -1e-3):
        opt.param_groups[0]["lr"] = bad
        x, y = harness.batch("gpt2", 0)
        with pytest.raises(InvalidArgumentError, match="must be finite and >= 0"):
            engine.backward(harness.loss_of("gpt2", engine, x, y))
    engine.close()
