"""SGD (torch.optim.SGD's update: momentum, dampening, nesterov, weight decay) trains as
torch.optim.SGD does, from a client torch optimizer or the config's "type": "SGD", under stages
0-3 with cpu and nvme offload, with parameter groups of their own momentum and lr, and with a
client LR scheduler.
"""

import pytest
import torch

import harness
import strata
from strata import InvalidArgumentError

STEPS = 5
CASES = {c[0]: c for c in harness.GRID}
SETTINGS = {
    "momentum_nesterov_decay": {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
    "momentum_dampening": {"lr": 0.05, "momentum": 0.8, "dampening": 0.3},
    "plain_decay": {"lr": 0.1, "weight_decay": 0.01},
}


def groups_of(model, two_groups):
    if not two_groups:
        return model.parameters()
    weights = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": weights}, {"params": rest, "lr": 0.02, "momentum": 0.5}]


def reference(settings, accum, clip, two_groups=False, schedule=None):
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    opt = torch.optim.SGD(groups_of(model, two_groups), **settings)
    return harness.reference_loop("gpt2", model, opt, STEPS, accum, clip,
                                  sched=schedule(opt) if schedule else None)


def train(case, tmp_path, settings, client, two_groups=False, schedule=None):
    return harness.train_with_optimizer(
        case, tmp_path, lambda m: groups_of(m, two_groups), STEPS, schedule=schedule,
        client=(lambda g: torch.optim.SGD(g, **settings)) if client else None,
        section={"type": "SGD", "params": dict(settings)})


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("name", ["stage0", "stage1_cpu", "stage2_cpu_clip",
                                  "stage3_cpu_release", "stage3_nvme_clip_accum"])
def test_sgd_from_the_config_matches_torch(name, setting, tmp_path):
    case = CASES[name]
    got = train(case, tmp_path, SETTINGS[setting], client=False)
    harness.assert_close(got, reference(SETTINGS[setting], case[4], case[5]))


def test_a_client_sgd_with_groups_and_a_schedule_matches_torch(tmp_path):
    case = CASES["stage3_nvme_clip_accum"]
    s = SETTINGS["momentum_nesterov_decay"]
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)  # noqa: E731
    got = train(case, tmp_path, s, client=True, two_groups=True, schedule=sched)
    harness.assert_close(got, reference(s, case[4], case[5], two_groups=True, schedule=sched))


def test_bad_sgd_settings_are_refused_by_name(tmp_path):
    case = CASES["stage0"]
    with pytest.raises(InvalidArgumentError, match="nesterov=true needs momentum > 0"):
        train(case, tmp_path, {"lr": 0.1, "nesterov": True}, client=False)
    # A momentum buffer in bf16 runs (the compact path, test_compact_layouts); SGD without
    # momentum has no state for optimizer_state_dtype to change.
    with pytest.raises(InvalidArgumentError, match="SGD without momentum keeps no optimizer state"):
        torch.manual_seed(0)
        model = harness.MODELS["gpt2"]()
        cfg = harness.config_for(case, tmp_path / "nvme")
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
        cfg["strata"]["optimizer_state_dtype"] = "bf16"
        strata.initialize(model=model, config=cfg)
