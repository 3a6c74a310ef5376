"""Adagrad and Lion, DeepSpeed's other CPU optimizers, train as their references do: Adagrad as
torch.optim.Adagrad (lr_decay and weight decay included), Lion as the published update rule
written out below in plain PyTorch (torch has no Lion). Each from the config's "type" and from a
client optimizer object (torch.optim.Adagrad; deepspeed.ops' DeepSpeedCPULion), under stages 0-3
with cpu and nvme offload, with parameter groups and a client LR scheduler; and the refusals.
"""

import copy

import pytest
import torch

import harness
import strata
from strata import InvalidArgumentError
from strata.ops import DeepSpeedCPUAdagrad, DeepSpeedCPULion

STEPS = 5
CASES = {c[0]: c for c in harness.GRID}
STAGES = ["stage0", "stage1_cpu", "stage2_cpu_clip", "stage3_cpu_release", "stage3_nvme_clip_accum"]


class PaperLion(torch.optim.Optimizer):
    """Lion from Chen et al. 2023 (Algorithm 2), one tensor operation per line of the paper:
    c = b1*m + (1-b1)*g; theta -= lr*(sign(c) + wd*theta); m = b2*m + (1-b2)*g, with the decay
    applied first as a multiplication by (1 - lr*wd), the form DeepSpeed's CPU Lion uses."""

    def __init__(self, params, lr, betas=(0.9, 0.999), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                c = b1 * m + (1 - b1) * p.grad
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.sub_(group["lr"] * torch.sign(c))
                m.copy_(b2 * m + (1 - b2) * p.grad)


OPTIMIZERS = {
    # name: (config type, reference class, client class, settings by name)
    "adagrad": ("Adagrad", torch.optim.Adagrad, torch.optim.Adagrad, {
        "decay_lr_decay": {"lr": 0.05, "weight_decay": 1e-3, "lr_decay": 0.01},
        "plain": {"lr": 0.1},
    }),
    "lion": ("Lion", PaperLion, DeepSpeedCPULion, {
        "decay": {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1},
        "plain": {"lr": 2e-3},
    }),
}


def groups_of(model, two_groups, lr):
    if not two_groups:
        return model.parameters()
    weights = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": weights}, {"params": rest, "lr": lr * 0.4, "weight_decay": 0.0}]


def reference(kind, settings, accum, clip, two_groups=False, schedule=None):
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    opt = OPTIMIZERS[kind][1](groups_of(model, two_groups, settings["lr"]), **settings)
    return harness.reference_loop("gpt2", model, opt, STEPS, accum, clip,
                                  sched=schedule(opt) if schedule else None)


def train(kind, case, tmp_path, settings, client, two_groups=False, schedule=None):
    params = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}
    return harness.train_with_optimizer(
        case, tmp_path, lambda m: groups_of(m, two_groups, settings["lr"]), STEPS,
        schedule=schedule,
        client=(lambda g: OPTIMIZERS[kind][2](g, **settings)) if client else None,
        section={"type": OPTIMIZERS[kind][0], "params": params})


@pytest.mark.parametrize("kind,setting", [(k, s) for k in sorted(OPTIMIZERS)
                                          for s in sorted(OPTIMIZERS[k][3])])
@pytest.mark.parametrize("name", STAGES)
def test_from_the_config_matches_the_reference(kind, setting, name, tmp_path):
    case = CASES[name]
    settings = OPTIMIZERS[kind][3][setting]
    got = train(kind, case, tmp_path, settings, client=False)
    harness.assert_close(got, reference(kind, settings, case[4], case[5]))


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_client_optimizer_with_groups_and_a_schedule_matches(kind, tmp_path):
    case = CASES["stage3_nvme_clip_accum"]
    settings = next(iter(OPTIMIZERS[kind][3].values()))
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)  # noqa: E731
    got = train(kind, case, tmp_path, settings, client=True, two_groups=True, schedule=sched)
    harness.assert_close(got, reference(kind, settings, case[4], case[5], two_groups=True,
                                        schedule=sched))


def test_an_optimizer_callable_gets_the_parameters(tmp_path):
    # DeepSpeed's initialize(optimizer=callable): called with model_parameters, its result used.
    case = CASES["stage2_cpu_clip"]
    settings = OPTIMIZERS["adagrad"][3]["decay_lr_decay"]
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    cfg = harness.config_for(case, tmp_path / "nvme")
    del cfg["optimizer"]
    seen = []

    def build(params):
        params = list(params)
        seen.append(len(params))
        return DeepSpeedCPUAdagrad(params, lr=settings["lr"], weight_decay=settings["weight_decay"])

    engine, opt, _, _ = strata.initialize(model=model, config=cfg, optimizer=build,
                                          model_parameters=model.parameters())
    assert seen == [len(list(model.parameters()))]
    assert engine.config["optimizer"]["type"] == "Adagrad"
    assert opt.param_groups[0]["lr"] == settings["lr"]
    got = harness.run_steps(engine, "gpt2", 0, STEPS, case[4])
    engine.close()
    no_lr_decay = {"lr": settings["lr"], "weight_decay": settings["weight_decay"]}
    harness.assert_close(got, reference("adagrad", no_lr_decay, case[4], case[5]))


def test_lion_outside_an_engine_is_the_paper_rule():
    # deepspeed.ops' Lion on a plain model (what a script does before initialize) is the same
    # update as the reference: both are tensor code, so this holds to float rounding.
    torch.manual_seed(0)
    a = harness.MODELS["gpt2"]()
    b = copy.deepcopy(a)
    la = harness.reference_loop("gpt2", a, DeepSpeedCPULion(a.parameters(), lr=1e-3,
                                                            weight_decay=0.1), STEPS)
    lb = harness.reference_loop("gpt2", b, PaperLion(b.parameters(), lr=1e-3, weight_decay=0.1),
                                STEPS)
    harness.assert_close(la, lb, rel=1e-6)


def test_bad_settings_are_refused_by_name(tmp_path):
    # Stage 1: a torch optimizer Strata cannot run as its own would run itself at stage 0 (as
    # DeepSpeed runs any optimizer there; test_client_optimizer).
    case = CASES["stage1"]
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    cfg = harness.config_for(case, tmp_path / "nvme")
    del cfg["optimizer"]
    with pytest.raises(InvalidArgumentError,
                       match="initial_accumulator_value.*zero_allow_untested_optimizer"):
        strata.initialize(model=model, config=cfg, optimizer=torch.optim.Adagrad(
            model.parameters(), lr=0.1, initial_accumulator_value=0.1))
    bad = copy.deepcopy(cfg)
    bad["optimizer"] = {"type": "Adagrad", "params": {"lr": 0.1, "initial_accumulator_value": 0.5}}
    with pytest.raises(InvalidArgumentError, match="initial_accumulator_value"):
        strata.initialize(model=model, config=bad)
    bad = copy.deepcopy(cfg)
    bad["optimizer"] = {"type": "Lion", "params": {"lr": 1e-3, "eps": 1e-8}}
    with pytest.raises(InvalidArgumentError, match="eps"):
        strata.initialize(model=model, config=bad)
    # Lion's momentum in bf16 or 8 bits runs (through the compact path, test_compact_layouts);
    # what has no meaning is refused: SGD without momentum keeps no state to compress.
    bad = copy.deepcopy(cfg)
    bad["optimizer"] = {"type": "SGD", "params": {"lr": 1e-3}}
    bad["strata"]["optimizer_state_dtype"] = "int8"
    with pytest.raises(InvalidArgumentError, match="SGD without momentum keeps no optimizer state"):
        strata.initialize(model=model, config=bad)
    bad = copy.deepcopy(cfg)
    bad["optimizer"] = {"type": "Lamb", "params": {"lr": 1e-3}}
    with pytest.raises(InvalidArgumentError, match="Adam, AdamW, SGD, Adagrad and Lion"):
        strata.initialize(model=model, config=bad)
    with pytest.raises(InvalidArgumentError, match="neither a torch optimizer"):
        strata.initialize(model=model, config=cfg, optimizer=42)


# Note [states the optimizer uses]: each optimizer keeps only its own states, so it needs less
# device memory than AdamW by one 4-byte moment per parameter for each it does not keep, and its
# checkpoints hold only those states and still resume bit for bit.
STATE_CASES = {
    # name: (config optimizer section, moments it keeps)
    "sgd": ({"type": "SGD", "params": {"lr": 0.05}}, 0),
    "sgd_momentum": ({"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}, 1),
    "adagrad": ({"type": "Adagrad", "params": {"lr": 0.05}}, 1),
    "lion": ({"type": "Lion", "params": {"lr": 1e-3, "weight_decay": 0.1}}, 1),
}


def _built(case, tmp_path, section):
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    cfg = harness.config_for(case, tmp_path / "nvme")
    cfg["optimizer"] = section
    engine, *_ = strata.initialize(model=model, config=copy.deepcopy(cfg))
    return engine


@pytest.mark.parametrize("name", sorted(STATE_CASES))
def test_each_optimizer_keeps_only_its_states(name, tmp_path):
    section, moments = STATE_CASES[name]
    adamw = _built(CASES["stage0"], tmp_path, {"type": "AdamW", "params": {"lr": 1e-3}})
    full = adamw._cpp.device_bytes_in_use
    adamw.close()
    engine = _built(CASES["stage0"], tmp_path, section)
    n = engine._cpp.num_parameters
    saved = full - engine._cpp.device_bytes_in_use
    engine.close()
    assert 4 * n * (2 - moments) <= saved < 4 * n * (2 - moments) + (64 << 10)


@pytest.mark.parametrize("name", sorted(STATE_CASES))
def test_a_checkpoint_of_only_those_states_resumes_bit_for_bit(name, tmp_path):
    section, _ = STATE_CASES[name]
    case = CASES["stage3_nvme_clip_accum"]
    straight = _built(case, tmp_path, section)
    want = harness.run_steps(straight, "gpt2", 0, 4, case[4])
    straight.close()
    first = _built(case, tmp_path, section)
    harness.run_steps(first, "gpt2", 0, 2, case[4])
    first.save_checkpoint(tmp_path / "ckpt")
    first.close()
    second = _built(case, tmp_path, section)
    second.load_checkpoint(tmp_path / "ckpt")
    got = harness.run_steps(second, "gpt2", 2, 2, case[4])
    second.close()
    assert got == want[2:]


def test_sgd_momentum_cannot_appear_after_initialize(tmp_path):
    engine, opt, _, _ = strata.initialize(model=harness.MODELS["gpt2"](), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    opt.param_groups[0]["momentum"] = 0.9
    with pytest.raises(InvalidArgumentError, match="keeps no momentum buffer"):
        harness.run_steps(engine, "gpt2", 0, 1)
    engine.close()
