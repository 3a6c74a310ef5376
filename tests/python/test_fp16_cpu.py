"""fp16 on the CPU device: the engine keeps fp16's semantics (fp16 parameters and gradients, an
fp32 master, dynamic loss scaling with DeepSpeed's parameters, overflow skips that leave the
weights and the schedule alone) and computes each operator in fp32 (strata/cpu_half.py).

The reference is plain PyTorch making the same casts: an fp16 copy of the model run under the same
operator mode, an fp32 master stepped by torch.optim.AdamW, the loss scaled in fp32 as DeepSpeed's
scaler does, and the scale moved by DeepSpeed's rules, written out below from its documentation
rather than taken from Strata."""

import copy
import math

import pytest
import torch

import harness
import strata
from strata import cpu_half

pytestmark = pytest.mark.skipif(harness.DEVICE.type != "cpu", reason="the CPU device's fp16")

STEPS = 6
# fp16 rounds each operator's result to 11 bits: the engine's Adam and torch's AdamW differ in
# the last bits of the fp32 master, which can flip the last bit of a weight's fp16 copy.
REL = 3e-3
FP16 = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 3, "hysteresis": 2,
        "min_loss_scale": 1}


class Scaler:
    """DeepSpeed's dynamic loss scale: an overflow spends one unit of hysteresis, and halves the
    scale (not below min_loss_scale) when none is left; loss_scale_window steps without an
    overflow double it."""

    def __init__(self, fp16):
        self.scale = 2.0 ** fp16["initial_scale_power"]
        self.window = fp16["loss_scale_window"]
        self.hysteresis = self.left = fp16["hysteresis"]
        self.min = fp16["min_loss_scale"]
        self.iter = 0
        self.last_overflow = -1

    def update(self, overflow):
        if overflow:
            if self.hysteresis == 1 or self.left == 1:
                self.scale = max(self.scale / 2, self.min)
            else:
                self.left -= 1
            self.last_overflow = self.iter
        elif (self.iter - self.last_overflow) % self.window == 0:
            self.left = self.hysteresis
            self.scale *= 2
        self.iter += 1


def inputs(model_name, step):
    x, y = harness.batch(model_name, step)
    return (x.half() if x.is_floating_point() else x), y


def fp16_reference(model_name, steps, poison=()):
    """Plain PyTorch fp16 training with an fp32 master; `poison`: steps whose loss is multiplied
    by inf. Returns (losses, applied flags, scales before each step)."""
    cpu_half.enable()
    torch.manual_seed(0)
    model = harness.MODELS[model_name]()
    master = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    model.half()
    opt = torch.optim.AdamW(master, lr=harness.LR, weight_decay=harness.WEIGHT_DECAY)
    scaler = Scaler(FP16)
    losses, applied, scales = [], [], []
    for step in range(steps):
        with torch.no_grad():
            for p, m in zip(model.parameters(), master):
                p.copy_(m)
        x, y = inputs(model_name, step)
        loss = harness.loss_of(model_name, model, x, y)
        losses.append(loss.item())
        scales.append(scaler.scale)
        if step in poison:
            loss = loss * math.inf
        (loss.float() * scaler.scale).backward()
        grads = [p.grad.float() / scaler.scale for p in model.parameters()]
        overflow = not all(torch.isfinite(g).all() for g in grads)
        if not overflow:
            for m, g in zip(master, grads):
                m.grad = g
            opt.step()
            opt.zero_grad()
        model.zero_grad(set_to_none=True)
        scaler.update(overflow)
        applied.append(not overflow)
    return losses, applied, scales


def fp16_strata(model_name, case, tmp_path, steps, poison=()):
    _, stage, param, optim, _, _, keep_live = case
    cfg = harness.config_for((case[0], stage, param, optim, 1, 0.0, keep_live), tmp_path / "nvme",
                             fp16=copy.deepcopy(FP16))
    torch.manual_seed(0)
    model = harness.MODELS[model_name]()
    engine, opt, _, _ = strata.initialize(model=model, model_parameters=model.parameters(),
                                          config=cfg)
    assert engine.fp16_enabled()
    assert all(p.dtype == torch.float16 for p in engine.module.parameters())
    losses, applied, scales = [], [], []
    for step in range(steps):
        x, y = inputs(model_name, step)
        loss = harness.loss_of(model_name, engine, x, y)
        assert loss.dtype == torch.float16
        losses.append(loss.item())
        scales.append(opt.cur_scale)
        assert opt.loss_scale == opt.cur_scale
        engine.backward(loss * math.inf if step in poison else loss)
        before = [t.clone() for t in engine.master_parameters()] if step in poison else None
        engine.step()
        applied.append(engine.was_step_applied())
        assert opt.overflow == (not applied[-1])
        assert engine.last_report["loss_scale"] == scales[-1]
        if before is not None:
            # A skipped step leaves the master weights as they were.
            for b, a in zip(before, engine.master_parameters()):
                assert torch.equal(b, a)
    engine.close()
    return losses, applied, scales


CASES = [c for c in harness.GRID if c[0] in (
    "stage0", "stage1_cpu", "stage2_cpu_clip", "stage2_nvme", "stage3", "stage3_cpu_release",
    "stage3_nvme_clip_accum")]


@pytest.mark.parametrize("model_name", ["kwargs", "gpt2", "resnet18"])
def test_fp16_matches_the_same_casts_in_pytorch(model_name, tmp_path):
    want, want_applied, want_scales = fp16_reference(model_name, STEPS)
    got, applied, scales = fp16_strata(model_name, CASES[0], tmp_path, STEPS)
    # 2^16 overflows where the fp16 loss's gradient is formed (the scale itself, rounded to fp16):
    # the first step is skipped at every stage, as DeepSpeed's first step is.
    assert want_applied[0] is False and any(want_applied)
    assert applied == want_applied
    assert scales == want_scales
    harness.assert_close(got, want, rel=REL)
    assert abs(want[-1] - want[0]) > 1e-3  # the losses move: the updates reached the weights


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forced_overflow_skips_the_step(case, tmp_path):
    poison = (3,)
    want, want_applied, want_scales = fp16_reference("kwargs", STEPS, poison)
    got, applied, scales = fp16_strata("kwargs", case, tmp_path, STEPS, poison)
    assert want_applied[3] is False and applied == want_applied
    assert scales == want_scales
    harness.assert_close(got, want, rel=REL)


def test_overflow_leaves_the_schedule_where_it_was(tmp_path):
    cfg = harness.config_for(CASES[0], tmp_path, fp16={"enabled": True, "initial_scale_power": 8},
                             scheduler={"type": "WarmupLR",
                                        "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                   "warmup_num_steps": 10}})
    torch.manual_seed(0)
    model = harness.MODELS["kwargs"]()
    engine, opt, _, sched = strata.initialize(model=model, model_parameters=model.parameters(),
                                              config=cfg)
    lrs = []
    for step in range(4):
        x, y = inputs("kwargs", step)
        loss = harness.loss_of("kwargs", engine, x, y)
        engine.backward(loss * math.inf if step == 2 else loss)
        engine.step()
        lrs.append(engine.get_lr()[0])
    engine.close()
    # Steps 0, 1 and 3 move the warm-up; the overflow at step 2 does not.
    assert lrs[1] > lrs[0] and lrs[2] == lrs[1] and lrs[3] > lrs[2], lrs


def _fp16_engine(case, tmp_path):
    cfg = harness.config_for(case, tmp_path, fp16=copy.deepcopy(FP16))
    torch.manual_seed(0)
    model = harness.MODELS["kwargs"]()
    engine, opt, _, _ = strata.initialize(model=model, model_parameters=model.parameters(),
                                          config=cfg)
    return engine, opt


def _fp16_steps(engine, opt, steps, poison=()):
    out = []
    for step in steps:
        x, y = inputs("kwargs", step)
        loss = harness.loss_of("kwargs", engine, x, y)
        out.append((loss.item(), opt.cur_scale))
        engine.backward(loss * math.inf if step in poison else loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary:
            out[-1] += (engine.was_step_applied(),)
    return out


@pytest.mark.parametrize("case", [CASES[0], CASES[-1]], ids=[CASES[0][0], CASES[-1][0]])
def test_a_resumed_fp16_run_scales_as_the_uninterrupted_one(case, tmp_path):
    """The loss scaler's state (scale, hysteresis, its step count and last overflow) is in the
    checkpoint: after overflows have moved the scale, a resumed run sees the same scales, skips
    the same steps and ends with the same master weights as the run that went on."""
    # Micro-steps, in whole accumulation windows (the last case accumulates 2).
    first, later = range(6), range(6, 6 + 4 * FP16["loss_scale_window"])
    engine, opt = _fp16_engine(case, tmp_path / "a")
    _fp16_steps(engine, opt, first, poison=(1, 2))
    assert opt.cur_scale != 2.0 ** FP16["initial_scale_power"]  # the overflows moved it
    engine.save_checkpoint(tmp_path / "ckpt")
    want = _fp16_steps(engine, opt, later, poison=(8,))
    want_master = [t.clone() for t in engine.master_parameters()]
    engine.close()
    engine, opt = _fp16_engine(case, tmp_path / "b")
    engine.load_checkpoint(tmp_path / "ckpt")
    got = _fp16_steps(engine, opt, later, poison=(8,))
    got_master = [t.clone() for t in engine.master_parameters()]
    engine.close()
    assert [w[1] for w in want] != [want[0][1]] * len(want)  # the scale moves after the resume
    assert got == want
    assert all(torch.equal(g, w) for g, w in zip(got_master, want_master))


@pytest.mark.parametrize("case", [CASES[0], CASES[-1]], ids=[CASES[0][0], CASES[-1][0]])
def test_an_overflow_at_the_minimum_scale_raises_and_leaves_the_engine_usable(case, tmp_path):
    """An overflow while the scale sits at min_loss_scale raises, as DeepSpeed's does. The step
    stayed open after it: every later step raised again, and load_checkpoint was refused until
    destroy(). The step now closes as the skipped step it is: a script that catches the error
    can load its last checkpoint, which then trains on exactly as a fresh engine from it."""
    fp16 = dict(FP16, initial_scale_power=1, hysteresis=1)  # 2, then the minimum, 1
    cfg = harness.config_for(case, tmp_path / "nvme", fp16=fp16)
    accum = cfg["gradient_accumulation_steps"]

    def engine_from(path=None):
        torch.manual_seed(0)
        engine, opt, _, _ = strata.initialize(model=harness.MODELS["kwargs"](),
                                              config=copy.deepcopy(cfg))
        if path is not None:
            engine.load_checkpoint(path)
        return engine, opt

    engine, opt = engine_from()
    _fp16_steps(engine, opt, range(accum))
    engine.save_checkpoint(tmp_path / "ck")
    before = [t.clone() for t in engine.master_parameters()]
    _fp16_steps(engine, opt, range(accum, 2 * accum), poison=(accum,))  # 2 -> 1
    assert opt.cur_scale == 1
    with pytest.raises(strata.StrataError, match="fp16 overflow at the minimum loss scale"):
        _fp16_steps(engine, opt, range(2 * accum, 3 * accum), poison=(2 * accum,))
    assert all(torch.equal(b, a) for b, a in zip(before, engine.master_parameters()))
    engine.load_checkpoint(tmp_path / "ck")
    got = _fp16_steps(engine, opt, range(3 * accum, 6 * accum))
    engine.close()
    engine, opt = engine_from(tmp_path / "ck")
    want = _fp16_steps(engine, opt, range(3 * accum, 6 * accum))
    engine.close()
    assert got == want


def test_a_damaged_or_older_loss_scale_in_a_checkpoint(tmp_path):
    """A malformed scaler state is refused before anything loads; a checkpoint that kept the
    scale alone (as older ones did) restores that scale."""
    import json
    engine, opt = _fp16_engine(CASES[0], tmp_path / "a")
    _fp16_steps(engine, opt, range(5), poison=(1, 2))
    saved_scale = opt.cur_scale
    assert saved_scale != 2.0 ** FP16["initial_scale_power"]
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    [manifest] = (tmp_path / "ckpt").glob("*/step-*/rank-00000.json")
    m = json.loads(manifest.read_text())
    assert set(m["scaler"]) == {"scale", "hysteresis_left", "iteration", "last_overflow_iteration"}
    for bad in ({"scale": "big"}, {"scale": 8.0, "hysteresis_left": 1, "iteration": 1e300,
                                   "last_overflow_iteration": -1},
                {"scale": -8.0}, {"scale": 8.0, "hysteresis_left": 0, "iteration": 5,
                                  "last_overflow_iteration": 2}):
        manifest.write_text(json.dumps(dict(m, scaler=bad)))
        engine, opt = _fp16_engine(CASES[0], tmp_path / "b")
        before = [t.clone() for t in engine.master_parameters()]
        with pytest.raises(strata.StrataError, match="loss scaler's state|the checkpoint is damaged"):
            engine.load_checkpoint(tmp_path / "ckpt")
        assert all(torch.equal(b, a) for b, a in zip(before, engine.master_parameters()))
        assert opt.cur_scale == 2.0 ** FP16["initial_scale_power"]
        engine.close()
    manifest.write_text(json.dumps(dict(m, scaler={"scale": m["scaler"]["scale"]})))
    engine, opt = _fp16_engine(CASES[0], tmp_path / "c")
    engine.load_checkpoint(tmp_path / "ckpt")
    assert opt.cur_scale == saved_scale
    engine.close()


def test_cpu_half_mode_keeps_views_and_running_statistics():
    cpu_half.enable()
    x = torch.arange(6, dtype=torch.float16)
    v = x.view(2, 3)
    v.mul_(2)  # an in-place operator through a view lands in the base
    assert x.tolist() == [0, 2, 4, 6, 8, 10]
    torch.exp_(v[0])  # no fp16 CPU kernel: computed in fp32, written back through the view
    assert x[0].item() == 1.0
    assert abs(x[1].item() / math.e ** 2 - 1) < 1e-3 and abs(x[2].item() / math.e ** 4 - 1) < 1e-3
    assert x[3:].tolist() == [6, 8, 10]
    bn = torch.nn.BatchNorm1d(3).half()
    bn(torch.randn(8, 3).half() + 5)
    assert bn.running_mean.dtype == torch.float16
    assert (bn.running_mean > 0.3).all()  # 0.1 of a mean of about 5
    lin = torch.nn.Linear(4, 2).half()
    out = lin(torch.randn(3, 4).half())
    assert out.dtype == torch.float16
    want = (lin.weight.float() @ torch.ones(4, 1)).squeeze(1) + lin.bias.float()
    assert torch.equal(lin(torch.ones(1, 4).half())[0], want.half())
