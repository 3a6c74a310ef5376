"""Parameter groups with their own lr, betas, eps and weight_decay (Hugging Face's Trainer puts
biases and norm weights in a group without weight decay) train as torch.optim.AdamW with the
same groups, under stages 0-3 x offload none/cpu/nvme, with clipping and accumulation, whether
the groups come from a client optimizer or from model_parameters dicts with the config's
optimizer. Small chunks (16 KiB) make most chunks hold parameters of both groups.
"""

import copy

import pytest
import torch

import harness
import strata
from strata import InvalidArgumentError

STEPS = 5
# A per-group schedule: the decay group's lr falls as 1/(s+1), the other halves each step.
LAMBDAS = [lambda s: 1 / (s + 1), lambda s: 0.5 ** s]


def split(model):
    """The Trainer's split: weights of matrices decay; biases and norm weights do not."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name or "ln" in name else decay).append(p)
    return decay, no_decay


def torch_groups(model):
    decay, no_decay = split(model)
    return [{"params": decay, "weight_decay": 0.05},
            {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3, "betas": (0.8, 0.99),
             "eps": 1e-6}]


def reference(accum, clip, with_schedule=False, world=1):
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    opt = torch.optim.AdamW(torch_groups(model), lr=harness.LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, LAMBDAS) if with_schedule else None
    return harness.reference_loop("gpt2", model, opt, STEPS, accum, clip, world=world, sched=sched)


def train(engine, accum):
    return harness.run_steps(engine, "gpt2", 0, STEPS, accum)


@pytest.mark.parametrize("case", harness.GRID, ids=[c[0] for c in harness.GRID])
def test_groups_of_a_client_optimizer_match_pytorch(case, tmp_path):
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    cfg = harness.config_for(case, tmp_path / "nvme")
    del cfg["optimizer"]
    opt = torch.optim.AdamW(torch_groups(model), lr=harness.LR)
    engine, returned, _, _ = strata.initialize(model=model, optimizer=opt, config=cfg)
    assert returned.param_groups is opt.param_groups
    harness.assert_close(train(engine, case[4]), reference(case[4], case[5]))
    engine.close()


@pytest.mark.parametrize("name", ["stage1_cpu", "stage3_nvme_clip_accum"])
def test_groups_as_model_parameters_dicts_with_a_per_group_schedule(name, tmp_path):
    case = {c[0]: c for c in harness.GRID}[name]
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    cfg = harness.config_for(case, tmp_path / "nvme")
    cfg["optimizer"]["params"] = {"lr": harness.LR}  # groups set their own decay
    engine, opt, _, _ = strata.initialize(
        model=model, model_parameters=torch_groups(model), config=copy.deepcopy(cfg),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, LAMBDAS))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    harness.assert_close(train(engine, case[4]), reference(case[4], case[5], with_schedule=True))
    # Each group followed its own lambda.
    assert [g["lr"] for g in opt.param_groups] == \
        pytest.approx([harness.LR / (STEPS + 1), 3e-3 * 0.5 ** STEPS])
    engine.close()


def test_a_group_with_a_bad_value_is_refused_by_group_and_name(tmp_path):
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    decay, no_decay = split(model)
    groups = [{"params": decay}, {"params": no_decay, "betas": (0.9, 1.5)}]
    with pytest.raises(InvalidArgumentError, match=r"parameter group 1: betas\[1\]=1.5"):
        strata.initialize(model=model, model_parameters=groups,
                          config=harness.config_for(harness.GRID[0], tmp_path / "nvme"))


def test_a_parameter_in_two_groups_is_refused_by_name(tmp_path):
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    params = list(model.parameters())
    groups = [{"params": params}, {"params": params[:1], "weight_decay": 0.0}]
    with pytest.raises(InvalidArgumentError, match="is in parameter groups 0 and 1"):
        strata.initialize(model=model, model_parameters=groups,
                          config=harness.config_for(harness.GRID[0], tmp_path / "nvme"))


@pytest.mark.parametrize("name", ["stage1_cpu", "stage3_nvme_clip_accum"])
def test_a_checkpoint_with_groups_and_their_schedule_resumes_bit_exactly(name, tmp_path):
    case = {c[0]: c for c in harness.GRID}[name]
    cfg = harness.config_for(case, tmp_path / "nvme")
    cfg["optimizer"]["params"] = {"lr": harness.LR}

    def make():
        torch.manual_seed(0)
        model = harness.MODELS["gpt2"]()
        engine, opt, _, _ = strata.initialize(
            model=model, model_parameters=torch_groups(model), config=copy.deepcopy(cfg),
            lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, LAMBDAS))
        return engine, opt

    engine, _ = make()
    harness.run_steps(engine, "gpt2", 0, 2, case[4])
    engine.save_checkpoint(tmp_path / "ckpt")
    straight = harness.run_steps(engine, "gpt2", 2, 3, case[4])
    engine.close()
    resumed, opt = make()
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([harness.LR / 3, 3e-3 * 0.25])
    assert harness.run_steps(resumed, "gpt2", 2, 3, case[4]) == straight
    resumed.close()


@pytest.mark.skipif(not harness.have_gloo(),
                    reason="this build has no c10d Gloo (its headers were missing at build time)")
@pytest.mark.parametrize("name", ["stage2_cpu_clip", "stage3_nvme_clip_accum"])
def test_two_ranks_with_groups_and_their_schedule_match_pytorch(name, tmp_path):
    ranks = harness.launch_two_ranks("param_groups_worker.py", [name, tmp_path], tmp_path)
    case = {c[0]: c for c in harness.GRID}[name]
    got = [(a + b) / 2 for a, b in zip(*ranks)]
    harness.assert_close(got, reference(case[4], case[5], with_schedule=True, world=2))
    assert ranks[0] != ranks[1]  # each rank trained on its own half of the batch
