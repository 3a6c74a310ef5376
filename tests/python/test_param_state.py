"""DeepSpeed's per-parameter API against independent references: the safe_get_full_* accessors
against master_parameters() and against plain PyTorch's AdamW state after the same steps, the
setters against what training does next, ZeRO-3's ds_* attributes against the engine's
gathers, and DeepSpeed's memory estimators against strata-estimate, at stages 0-3 with cpu and
nvme offload."""

import copy
import io
import json
import os
import re
import subprocess
import sys
from contextlib import redirect_stdout

import pytest
import torch

import harness
import strata
from strata import param_state

COMPAT = os.environ.get("STRATA_DS_COMPAT")
if COMPAT:
    sys.path.insert(0, COMPAT)

CASES = [c for c in harness.GRID if c[0] in ("stage0", "stage1_cpu", "stage2_nvme", "stage3",
                                            "stage3_cpu_release", "stage3_nvme_clip_accum")]
STEPS = 2


def _trained(case, tmp_path):
    cfg = harness.config_for(case, tmp_path / "nvme")
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    engine, _, _, _ = strata.initialize(model=model, model_parameters=model.parameters(),
                                        config=copy.deepcopy(cfg))
    harness.run_steps(engine, "gpt2", 0, STEPS, cfg["gradient_accumulation_steps"])
    return engine, cfg


def _reference(cfg):
    """Plain PyTorch: the same model, AdamW and loop; its optimizer holds the states."""
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    opt = torch.optim.AdamW(model.parameters(), lr=harness.LR, weight_decay=harness.WEIGHT_DECAY)
    harness.reference_loop("gpt2", model, opt, STEPS, cfg["gradient_accumulation_steps"],
                           cfg["gradient_clipping"])
    return model, opt


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_full_getters_match_master_and_plain_pytorch(case, tmp_path):
    engine, cfg = _trained(case, tmp_path)
    ref_model, ref_opt = _reference(cfg)
    names = [n for n, _ in engine.module.named_parameters()]
    params = dict(engine.module.named_parameters())
    masters = dict(zip(names, engine.master_parameters()))
    for name, ref_p in ref_model.named_parameters():
        p = params[name]
        full = param_state.safe_get_full_fp32_param(p)
        assert full.shape == ref_p.shape and full.dtype == torch.float32
        assert torch.equal(full.cpu(), masters[name]), name
        torch.testing.assert_close(harness.without_key_bias(name, full.cpu()),
                                   harness.without_key_bias(name, ref_p.detach()),
                                   rtol=1e-4, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            got = param_state.safe_get_full_optimizer_state(p, key)
            torch.testing.assert_close(got.cpu(), ref_opt.state[ref_p][key], rtol=1e-3, atol=1e-8,
                                       msg=lambda m: f"{name} {key}: {m}")
        # One rank: its shard holds the whole parameter.
        assert torch.equal(param_state.safe_get_local_fp32_param(p).cpu(), full.cpu().flatten())
    with pytest.raises(KeyError, match="exp_avg_sq"):
        param_state.safe_get_full_optimizer_state(params[names[0]], "momentum_buffer")
    stray = torch.nn.Parameter(torch.zeros(3))
    assert param_state.safe_get_full_fp32_param(stray) is None
    assert param_state.safe_get_full_optimizer_state(stray, "exp_avg") is None
    param_state.safe_set_full_fp32_param(stray, torch.ones(3))  # nothing, as DeepSpeed
    engine.close()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_setters_reach_the_next_step(case, tmp_path):
    """Setting a master and a moment, then one more step, equals plain PyTorch doing the same
    writes to its parameter and optimizer state before its step."""
    engine, cfg = _trained(case, tmp_path)
    params = dict(engine.module.named_parameters())
    name = "blocks.0.qkv.weight"
    shape = getattr(params[name], "ds_shape", params[name].shape)  # stage 3: 0 elements now
    value = torch.linspace(-0.5, 0.5, shape.numel()).view(shape)
    moment = torch.full(shape, 1e-3)
    param_state.safe_set_full_fp32_param(params[name], value)
    param_state.safe_set_full_optimizer_state(params[name], moment, "exp_avg")
    assert torch.equal(param_state.safe_get_full_fp32_param(params[name]).cpu(), value)
    assert torch.equal(param_state.safe_get_full_optimizer_state(params[name], "exp_avg").cpu(),
                       moment)
    with strata.zero.GatheredParameters(params[name]):
        assert torch.equal(params[name].detach().cpu().float(), value)
    got = harness.run_steps(engine, "gpt2", STEPS, 1, cfg["gradient_accumulation_steps"])

    torch.manual_seed(0)
    ref_model = harness.MODELS["gpt2"]()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=harness.LR,
                                weight_decay=harness.WEIGHT_DECAY)
    ref_p = dict(ref_model.named_parameters())[name]

    def write(step):
        if step == STEPS:
            with torch.no_grad():
                ref_p.copy_(value)
            ref_opt.state[ref_p]["exp_avg"].copy_(moment)

    want = harness.reference_loop("gpt2", ref_model, ref_opt, STEPS + 1,
                                  cfg["gradient_accumulation_steps"], cfg["gradient_clipping"],
                                  before_step=write)
    harness.assert_close(got, want[-1:])
    torch.testing.assert_close(param_state.safe_get_full_fp32_param(params[name]).cpu(),
                               ref_p.detach(), rtol=1e-4, atol=1e-6)
    with pytest.raises(strata.InvalidArgumentError, match="shape"):
        param_state.safe_set_full_fp32_param(params[name], torch.zeros(3))
    engine.close()


def test_zero3_parameter_attributes(tmp_path):
    case = next(c for c in harness.GRID if c[0] == "stage3_cpu_release")
    engine, _ = _trained(case, tmp_path)
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    assert ZeroParamStatus is param_state.ZeroParamStatus
    params = dict(engine.module.named_parameters())
    shapes = {n: p.shape for n, p in harness.MODELS["gpt2"]().named_parameters()}
    ids = [p.ds_id for p in params.values()]
    assert len(set(ids)) == len(ids) and all(isinstance(i, int) for i in ids)
    for name, p in params.items():
        assert p.ds_shape == shapes[name] and p.ds_numel == shapes[name].numel()
        # As in DeepSpeed: 0 elements while released, its shape while gathered.
        available = p.ds_status == ZeroParamStatus.AVAILABLE
        assert p.shape == (shapes[name] if available else (0,)), name
        assert isinstance(p, torch.nn.Parameter) and type(p).__name__ == "Parameter"
    w = params["blocks.0.fc.weight"]
    # Released between steps (persistence threshold 0), gathered inside the block and inside
    # its own unit's forward.
    assert w.ds_status == ZeroParamStatus.NOT_AVAILABLE
    with strata.zero.GatheredParameters(w):
        assert w.ds_status == ZeroParamStatus.AVAILABLE
        gathered = w.detach().clone()
    assert w.ds_status == ZeroParamStatus.NOT_AVAILABLE
    # ds_tensor: this rank's shard of the working copy (one rank: all of it), a copy.
    shard = w.ds_tensor
    assert torch.equal(shard.cpu(), gathered.cpu().flatten().to(shard.dtype))
    shard.zero_()
    assert not torch.equal(w.ds_tensor.cpu(), shard.cpu()) or gathered.abs().sum() == 0
    seen = []
    owner = next(m for m in engine.module.modules()
                 if any(q is w for q in m.parameters(recurse=False)))
    handle = owner.register_forward_hook(lambda m, i, o: seen.append(w.ds_status))
    harness.run_steps(engine, "gpt2", STEPS, 1)
    handle.remove()
    assert seen and all(s == ZeroParamStatus.AVAILABLE for s in seen), seen
    engine.destroy()
    assert type(w) is torch.nn.Parameter and not hasattr(w, "ds_id")
    assert not hasattr(w, "ds_shape") and w.shape == shapes["blocks.0.fc.weight"]


def test_no_ds_attributes_below_stage3(tmp_path):
    engine, _ = _trained(next(c for c in harness.GRID if c[0] == "stage2_cpu_clip"), tmp_path)
    assert not any(hasattr(p, "ds_id") for p in engine.module.parameters())
    engine.close()


def _estimate_cli(stage, param, optim, params, largest):
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {}}
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"est-{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    tool = os.path.join(os.environ["STRATA_BIN"], "strata-estimate")
    out = subprocess.run([tool, "--config", path, "--params", str(params), "--largest-layer",
                          str(largest), "--stage", str(stage), "--offload-param", param,
                          "--offload-optimizer", optim, "--device", "cuda", "--json"],
                         check=True, capture_output=True, text=True).stdout
    os.remove(path)
    return json.loads(out)


@pytest.mark.skipif("STRATA_BIN" not in os.environ, reason="needs the build's strata-estimate")
def test_estimators_print_deepspeeds_table_with_the_planners_figures():
    from deepspeed.runtime.zero.stage3 import (estimate_zero3_model_states_mem_needs,
                                               estimate_zero3_model_states_mem_needs_all_cold,
                                               estimate_zero3_model_states_mem_needs_all_live)
    from deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs, estimate_zero2_model_states_mem_needs_all_cold)
    P, L = 350_000_000, 25_000_000
    cli = _estimate_cli(3, "cpu", "cpu", P, L)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(P, L, num_gpus_per_node=1)
    assert gpu == cli["hbm_bytes"]
    assert cpu == cli["host_pinned_bytes"] + cli["host_pageable_bytes"]
    cli2 = _estimate_cli(2, "none", "none", P, P)
    cpu2, gpu2 = estimate_zero2_model_states_mem_needs(P, cpu_offload=False)
    assert gpu2 == cli2["hbm_bytes"]
    # Offloading moves the states off the GPU: every offloaded row needs less device memory.
    assert gpu < gpu2
    buf = io.StringIO()
    with redirect_stdout(buf):
        estimate_zero3_model_states_mem_needs_all_cold(P, L, num_gpus_per_node=2)
        estimate_zero2_model_states_mem_needs_all_cold(P)
    text = buf.getvalue()
    assert "HW: Setup with 1 node, 2 GPUs per node." in text
    assert "SW: Model with 350M total params, 25M largest layer params." in text
    rows = re.findall(r"^ +([\d.]+)GB \| +([\d.]+)GB \| (.*)$", text, re.M)
    assert len(rows) == 6 + 2, text
    assert rows[0][2] == "offload_param=cpu , offload_optimizer=cpu , zero_init=1"
    assert rows[6][2] == "offload_optimizer=cpu "
    assert text.count("Strata's planner") == 2
    # zero_init=0 holds the whole fp32 model per process while it is built: never less.
    assert float(rows[1][0]) >= float(rows[0][0]) and float(rows[1][0]) >= 2 * 4 * P / 2**30 - 0.01
    buf = io.StringIO()
    with redirect_stdout(buf):
        estimate_zero3_model_states_mem_needs_all_live(harness.MODELS["gpt2"]())
    assert "per CPU  |  per GPU" in buf.getvalue()


@pytest.mark.skipif(not harness.have_gloo(), reason="this build has no Gloo for two ranks")
@pytest.mark.parametrize("name", ["stage2_cpu_clip", "stage3_nvme_clip_accum"])
def test_two_ranks_see_the_same_whole_values(name, tmp_path):
    """On two ranks the full accessors are collective: both ranks get the same whole values,
    equal to plain PyTorch's parameter and AdamW state after the same whole-batch steps; each
    rank's local shard is its part of the whole; a write lands on both."""
    ranks = harness.launch_two_ranks("param_state_worker.py", [name, tmp_path / "nvme"], tmp_path)
    torch.manual_seed(0)
    ref_model = harness.MODELS["gpt2"]()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=harness.LR,
                                weight_decay=harness.WEIGHT_DECAY)
    harness.reference_loop("gpt2", ref_model, ref_opt, 2, 1, 0.0, world=2)
    for pname, ref_p in ref_model.named_parameters():
        for key in ("full", "exp_avg", "exp_avg_sq"):
            assert ranks[0][key][pname] == ranks[1][key][pname], (pname, key)
        want = ref_p.detach().flatten()
        # Two ranks sum each gradient in another order than one process: where a gradient is
        # ~0, Adam's normalised step turns that rounding into moves of up to ~1% of lr.
        torch.testing.assert_close(torch.tensor(ranks[0]["full"][pname]), want, rtol=1e-4,
                                   atol=1e-5)
        torch.testing.assert_close(torch.tensor(ranks[0]["exp_avg"][pname]),
                                   ref_opt.state[ref_p]["exp_avg"].flatten(), rtol=1e-3,
                                   atol=1e-8)
        local = ranks[0]["local"][pname] + ranks[1]["local"][pname]
        assert len(local) == ref_p.numel(), pname  # the two shards split the parameter
        assert local == ranks[0]["full"][pname], pname
        if ranks[0]["ds_tensor"]:
            shards = ranks[0]["ds_tensor"][pname] + ranks[1]["ds_tensor"][pname]
            assert len(shards) == ref_p.numel(), pname
    written = torch.linspace(-1, 1, len(ranks[0]["after_set"])).tolist()
    for r in ranks:
        assert r["after_set"] == pytest.approx(written, abs=1e-7)
        assert r["gathered_after_set"] == pytest.approx(written, abs=1e-7)
