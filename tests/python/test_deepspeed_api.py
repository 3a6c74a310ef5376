"""The `deepspeed` compatibility surface, item by item, against DeepSpeed's contract: each test
compares with an independent reference (plain PyTorch, the values GatheredParameters shows, a
file on disk) rather than with Strata itself."""

import argparse
import copy
import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
import torch

import harness
import strata

COMPAT = os.environ.get("STRATA_DS_COMPAT")
if not COMPAT:
    pytest.skip("STRATA_DS_COMPAT (the build's deepspeed-compat folder) is not set",
                allow_module_level=True)
sys.path.insert(0, COMPAT)
import deepspeed  # noqa: E402

STAGE0 = next(c for c in harness.GRID if c[0] == "stage0")
STAGE2_CPU = next(c for c in harness.GRID if c[0] == "stage2_cpu_clip")
STAGE3 = next(c for c in harness.GRID if c[0] == "stage3")
STAGE3_NVME = next(c for c in harness.GRID if c[0] == "stage3_nvme_clip_accum")


def _engine(model_name, cfg, **kw):
    torch.manual_seed(0)
    model = harness.MODELS[model_name]()
    engine, opt, loader, sched = deepspeed.initialize(model=model, config=copy.deepcopy(cfg), **kw)
    return engine


# --- the package -------------------------------------------------------------------------------
def test_package_is_strata_with_deepspeed_metadata():
    assert deepspeed.__strata__ is True
    version = importlib.metadata.version("deepspeed")
    assert version.startswith("0.16.0+strata"), version
    assert deepspeed.DeepSpeedEngine is strata.StrataEngine
    # The names Hugging Face reads right after `import deepspeed`.
    assert "WarmupLR" in deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES
    import logging

    from deepspeed.utils import logger
    assert isinstance(logger, logging.Logger)


def test_submodules_resolve():
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    assert dist.get_rank() == 0 and callable(get_accelerator)
    assert callable(clone_tensors_for_torch_save) and callable(get_fp32_state_dict_from_zero_checkpoint)
    assert issubclass(DeepSpeedCPUAdam, torch.optim.Optimizer)
    assert issubclass(FusedAdam, torch.optim.Optimizer)
    # The pipeline names, where DeepSpeed's scripts import them from (strata/pipe.py).
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe.module import PipelineModule as ModulePipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    assert PipelineModule is ModulePipelineModule is deepspeed.PipelineModule
    assert issubclass(TiedLayerSpec, LayerSpec) and issubclass(PipelineEngine, strata.StrataEngine)
    coord = PipeDataParallelTopology(2, 3).get_coord(4)
    assert (coord.pipe, coord.data) == (1, 1)
    assert PipeDataParallelTopology(2, 3).get_rank(pipe=1, data=1) == 4


@pytest.mark.parametrize("call, words", [
    (lambda: __import__("deepspeed.moe.layer", fromlist=["x"]).MoE(hidden_size=4),
     "mixture of experts"),
    (lambda: __import__("deepspeed.compression.compress", fromlist=["x"]).init_compression(None, ""),
     "compression"),
    (lambda: deepspeed.init_inference(torch.nn.Linear(2, 2)), "inference engine"),
    (lambda: deepspeed.zero.MiCS_Init(
        config_dict_or_path={"zero_optimization": {"stage": 3, "mics_shard_size": 2}}),
     "MiCS"),
])
def test_unimplemented_features_are_refused_by_name(call, words):
    with pytest.raises(NotImplementedError, match=words) as info:
        call()
    assert "Strata" in str(info.value)


def test_unknown_name_in_refused_module_says_why():
    import deepspeed.moe
    with pytest.raises(AttributeError, match="mixture of experts"):
        deepspeed.moe.sharded_moe  # noqa: B018


# --- module-level API --------------------------------------------------------------------------
def test_add_config_arguments_adds_deepspeeds_four_flags():
    p = deepspeed.add_config_arguments(argparse.ArgumentParser())
    added = {o for a in p._actions for o in a.option_strings} - {"-h", "--help"}
    assert added == {"--deepspeed", "--deepspeed_config", "--deepscale", "--deepscale_config"}
    a = p.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert a.deepspeed and a.deepspeed_config == "ds.json"
    b = p.parse_args(["--deepscale", "--deepscale_config", "x.json"])
    assert b.deepscale and b.deepscale_config == "x.json"
    assert not p.parse_args([]).deepspeed
    # A script's own --local_rank, declared after the call (no conflict) or before it.
    p.add_argument("--local_rank", type=int, default=-1)
    assert p.parse_args(["--local_rank=1"]).local_rank == 1
    q = argparse.ArgumentParser()
    q.add_argument("--local_rank", type=int, default=7)
    assert deepspeed.add_config_arguments(q).parse_args([]).local_rank == 7


OWN_LOCAL_RANK = """
import argparse, os, deepspeed
p = deepspeed.add_config_arguments(argparse.ArgumentParser())
p.add_argument("--local_rank", type=int, default=-1)
a = p.parse_args()
print(f"rank {os.environ['RANK']} local_rank {a.local_rank} deepspeed {a.deepspeed}")
"""
ENV_LOCAL_RANK = """
import argparse, os, deepspeed
a = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args()
print(f"rank {os.environ['RANK']} LOCAL_RANK {os.environ['LOCAL_RANK']}")
"""


@pytest.mark.skipif(not os.environ.get("STRATA_DS_COMPAT"), reason="STRATA_DS_COMPAT not set")
def test_launcher_passes_local_rank_or_not(tmp_path):
    (tmp_path / "own.py").write_text(OWN_LOCAL_RANK)
    (tmp_path / "env.py").write_text(ENV_LOCAL_RANK)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.environ["STRATA_DS_COMPAT"], os.environ.get("PYTHONPATH", "")]))

    def launch(args):
        return subprocess.run(["bash", "-c", f"{harness.deepspeed_command()} --num_gpus 2 {args}"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    own = launch("own.py --deepspeed")
    assert own.returncode == 0, own.stdout + own.stderr
    for r in (0, 1):
        assert f"rank {r} local_rank {r} deepspeed True" in own.stdout
    by_env = launch("--no_local_rank env.py")
    assert by_env.returncode == 0, by_env.stdout + by_env.stderr
    for r in (0, 1):
        assert f"rank {r} LOCAL_RANK {r}" in by_env.stdout
    # Without --no_local_rank, a script that declares no --local_rank rejects the launcher's, as
    # under DeepSpeed.
    refused = launch("env.py")
    assert refused.returncode != 0 and "unrecognized arguments: --local_rank=" in refused.stderr + refused.stdout


def test_initialize_reads_config_from_args(tmp_path):
    cfg = harness.config_for(STAGE0, tmp_path)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(
        ["--deepspeed", "--deepspeed_config", str(path)])
    torch.manual_seed(0)
    model = harness.kwargs_net()
    engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    assert engine.train_micro_batch_size_per_gpu() == cfg["train_micro_batch_size_per_gpu"]
    engine.close()


def test_config_with_comments_and_trailing_commas(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("""{
      // DeepSpeed reads configs with hjson
      "train_micro_batch_size_per_gpu": 2,   # a hash comment
      /* a block
         comment */
      "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.999,],},},
      "zero_optimization": {"stage": 2,},
    }""")
    engine = _engine("kwargs", str(path))
    assert engine.zero_optimization_stage() == 2
    assert engine.get_lr() == [pytest.approx(0.001)]
    engine.close()
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "train_micro_batch_size_per_gpu": 4}')
    with pytest.raises(ValueError, match="appears twice"):
        _engine("kwargs", str(path))


def test_comm_world_of_one_and_collectives(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    import deepspeed.comm as dist
    if not dist.is_initialized():
        dist.init_distributed()
    assert dist.is_initialized() and torch.distributed.is_initialized()
    assert (dist.get_rank(), dist.get_world_size(), dist.get_local_rank()) == (0, 1, 0)
    t = torch.tensor([3.0])
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    dist.barrier()
    out = [torch.zeros(1)]
    dist.all_gather(out, t)
    assert t.item() == 3.0 and out[0].item() == 3.0
    assert dist.ReduceOp.SUM == torch.distributed.ReduceOp.SUM


def test_accelerator_on_the_cpu_device():
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    assert acc.device_name() == "cpu" and acc.current_device_name() == "cpu"
    assert acc.is_available() and acc.device_count() >= 1
    assert acc.is_bf16_supported() and not acc.is_fp16_supported()
    assert acc.communication_backend_name() == "gloo"
    t = torch.ones(4)
    assert acc.pin_memory(t) is t and acc.on_accelerator(t)
    # The device counters are the stand-in device's: what live engines' allocators hold.
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    assert abs(acc.host_memory_resident() - rss) < 64 << 20
    before = acc.memory_allocated()
    engine, *_ = strata.initialize(model=torch.nn.Linear(512, 512), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    held = acc.memory_allocated()
    assert held - before == engine._cpp.device_bytes_in_use >= 4 * 512 * 513 * 4  # params + states
    assert acc.max_memory_allocated() >= held
    engine.close()
    assert acc.memory_allocated() == before
    acc.manual_seed(5)
    a = torch.rand(3)
    acc.manual_seed_all(5)
    assert torch.equal(a, torch.rand(3))
    acc.synchronize()
    acc.empty_cache()
    with pytest.raises(AttributeError, match="not part of Strata's accelerator"):
        acc.no_such_method()


def test_clone_tensors_for_torch_save_breaks_shared_storage():
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    flat = torch.arange(10.0)
    state = {"a": flat[:2], "b": [flat[2:4], (flat[4:5], 3)]}
    out = clone_tensors_for_torch_save(state)
    assert torch.equal(out["a"], flat[:2]) and out["b"][1][1] == 3
    assert out["a"].storage().size() == 2  # its own storage, not the flat buffer's


# --- the engine surface ------------------------------------------------------------------------
@pytest.mark.parametrize("case", [STAGE0, STAGE2_CPU, STAGE3], ids=lambda c: c[0])
def test_global_grad_norm_equals_torch_clip_norm(case, tmp_path):
    cfg = harness.config_for(case, tmp_path)
    engine = _engine("gpt2", cfg)
    assert engine.get_global_grad_norm() is None and not engine.was_step_applied()
    torch.manual_seed(0)
    ref = harness.gpt2()
    opt = torch.optim.AdamW(ref.parameters(), lr=harness.LR, weight_decay=harness.WEIGHT_DECAY)
    for step in range(3):
        x, y = harness.batch("gpt2", step)
        engine.backward(harness.loss_of("gpt2", engine, x, y))
        engine.step()
        harness.loss_of("gpt2", ref, x, y).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), case[5] or float("inf")).item()
        opt.step()
        opt.zero_grad()
        assert engine.get_global_grad_norm() == pytest.approx(norm, rel=1e-4)
        assert engine.was_step_applied()
    engine.close()


def test_engine_reports_precision_clipping_and_batch(tmp_path):
    cfg = harness.config_for(STAGE2_CPU, tmp_path)
    engine = _engine("kwargs", cfg)
    assert engine.fp16_enabled() is False and engine.bfloat16_enabled() is False
    assert engine.gradient_clipping() == cfg["gradient_clipping"]
    assert engine.train_batch_size() == cfg["train_micro_batch_size_per_gpu"] * cfg[
        "gradient_accumulation_steps"]
    assert engine.optimizer is not None and engine.local_rank == 0
    assert engine.device == torch.device("cpu")
    engine.close()
    bf16 = _engine("kwargs", dict(cfg, bf16={"enabled": True}))
    assert bf16.bfloat16_enabled() and not bf16.fp16_enabled()
    bf16.close()


def test_backward_scale_wrt_gas_false_matches_the_engine_dividing(tmp_path):
    cfg = harness.config_for(STAGE0, tmp_path, gradient_accumulation_steps=2)
    by_engine = _engine("gpt2", cfg)
    by_caller = _engine("gpt2", cfg)
    for step in range(2):
        for m in range(2):
            x, y = harness.batch("gpt2", step * 2 + m)
            by_engine.backward(harness.loss_of("gpt2", by_engine, x, y))
            by_engine.step()
            by_caller.set_gradient_accumulation_boundary(m == 1)
            by_caller.backward(harness.loss_of("gpt2", by_caller, x, y) / 2, scale_wrt_gas=False)
            if m == 1:
                by_caller.step()
    for a, b in zip(by_engine.master_parameters(), by_caller.master_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    by_engine.close()
    by_caller.close()


def test_boundary_that_does_not_match_the_config_is_refused(tmp_path):
    engine = _engine("gpt2", harness.config_for(STAGE0, tmp_path, gradient_accumulation_steps=2))
    x, y = harness.batch("gpt2", 0)
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(harness.loss_of("gpt2", engine, x, y))
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        engine.step()
    engine.close()


def _gathered_values(engine):
    out = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters(p):
            out[name] = p.detach().clone()
    return out


@pytest.mark.parametrize("case", [STAGE2_CPU, STAGE3], ids=lambda c: c[0])
def test_save_16bit_model_loads_strict_into_the_plain_model(case, tmp_path):
    z = dict(harness.config_for(case, tmp_path)["zero_optimization"],
             stage3_gather_16bit_weights_on_model_save=True)
    cfg = dict(harness.config_for(case, tmp_path), zero_optimization=z)
    engine = _engine("gpt2", cfg)
    harness.run_steps(engine, "gpt2", 0, 2)
    assert engine.zero_gather_16bit_weights_on_model_save()
    assert engine.save_16bit_model(str(tmp_path / "out"), "model.bin")
    state = torch.load(tmp_path / "out" / "model.bin")
    plain = harness.gpt2()
    plain.load_state_dict(state, strict=True)
    shown = _gathered_values(engine)
    for name, p in plain.named_parameters():
        assert torch.equal(p, shown[name]), name
    engine.close()


def test_save_16bit_model_under_stage3_needs_the_gather_flag(tmp_path):
    engine = _engine("gpt2", harness.config_for(STAGE3, tmp_path))
    assert engine.save_16bit_model(str(tmp_path / "out")) is False
    assert not (tmp_path / "out").exists()
    engine.close()


def test_checkpoint_names_follow_deepspeed(tmp_path):
    engine = _engine("kwargs", harness.config_for(STAGE0, tmp_path))
    harness.run_steps(engine, "kwargs", 0, 2)
    engine.save_checkpoint(tmp_path / "ck")
    assert (tmp_path / "ck" / "latest").read_text() == "global_step2"
    assert (tmp_path / "ck" / "global_step2").is_dir()
    engine.close()


def test_zero_to_fp32_of_a_stage3_nvme_checkpoint_equals_the_masters(tmp_path):
    from deepspeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                              get_fp32_state_dict_from_zero_checkpoint)
    cfg = harness.config_for(STAGE3_NVME, tmp_path / "nvme")
    engine = _engine("gpt2", cfg)
    harness.run_steps(engine, "gpt2", 0, 2, cfg["gradient_accumulation_steps"])
    engine.save_checkpoint(tmp_path / "ck")
    masters = engine.master_parameters()
    names = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    engine.close()
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ck")
    assert [n for n in state if n in names] == names
    for name, want in zip(names, masters):
        assert torch.equal(state[name], want), name
    # The plain module's own keys: tied weights under each name, persistent buffers.
    assert set(state) == set(harness.gpt2().state_dict())
    path = convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ck", tmp_path / "fp32")
    plain = harness.gpt2()
    plain.load_state_dict(torch.load(path), strict=True)
    # The command line does the same.
    import subprocess
    out = subprocess.run([sys.executable, "-m", "deepspeed.utils.zero_to_fp32", str(tmp_path / "ck"),
                          str(tmp_path / "cli.bin")], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert out.returncode == 0, out.stderr
    cli = torch.load(tmp_path / "cli.bin")
    assert all(torch.equal(cli[n], state[n]) for n in names)
    bad = subprocess.run([sys.executable, "-m", "deepspeed.utils.zero_to_fp32",
                          str(tmp_path / "nothing"), str(tmp_path / "x.bin")],
                         capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert bad.returncode == 2 and "no Strata checkpoint" in bad.stderr


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (3, "bf16")])
def test_frozen_parameters_are_saved_restored_and_in_zero_to_fp32(stage, precision, tmp_path):
    """Frozen parameters were neither saved nor restored: a run resumed into a model built
    afresh kept its random frozen weights, and zero_to_fp32's state_dict lacked them, so
    load_state_dict(strict=True) failed. exclude_frozen_parameters=True leaves them out, as
    DeepSpeed does, and a load then keeps the model's own."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    frozen_names = ["0.weight", "1.bias"]

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8),
                                    torch.nn.Linear(8, 2))
        model[0].requires_grad_(False)
        model[1].bias.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=copy.deepcopy(cfg))
        return model, engine

    def frozen_of(model):
        return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()
                if n in frozen_names}

    model, engine = build(0)
    for step in range(2):
        x = torch.randint(0, 10, (2, 3), generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).float().square().mean())
        engine.step()
    engine.save_checkpoint(tmp_path / "ck")
    engine.save_checkpoint(tmp_path / "ex", exclude_frozen_parameters=True)
    frozen, masters = frozen_of(model), engine.master_parameters()
    engine.close()

    other, engine = build(1)
    assert all(not torch.equal(v, frozen[n]) for n, v in frozen_of(other).items())
    engine.load_checkpoint(tmp_path / "ck")
    got = frozen_of(other)
    assert got.keys() == frozen.keys() and all(torch.equal(got[n], frozen[n]) for n in got)
    assert all(torch.equal(a, b) for a, b in zip(engine.master_parameters(), masters))
    engine.close()
    # Saved without them: the model's own values stay.
    other, engine = build(2)
    own = frozen_of(other)
    engine.load_checkpoint(tmp_path / "ex")
    assert all(torch.equal(v, own[n]) for n, v in frozen_of(other).items())
    engine.close()

    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ck")
    plain = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 2))
    plain.load_state_dict(state, strict=True)
    for name in frozen_names:
        assert state[name].dtype == torch.float32 and torch.equal(state[name], frozen[name])
    for without in (get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ex"),
                    get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ck",
                                                             exclude_frozen_parameters=True)):
        assert set(state) - set(without) == set(frozen_names)


def test_zero_to_fp32_refuses_a_damaged_shard_naming_the_file(tmp_path):
    """zero_to_fp32 reads through the engine's checked reader: one flipped byte in a master
    block, or a cut file, is refused naming the file, as load_checkpoint refuses it."""
    import glob
    import shutil

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from strata.zero_to_fp32 import CheckpointError
    cfg = harness.config_for(STAGE2_CPU, tmp_path / "nvme")
    engine = _engine("gpt2", cfg)
    harness.run_steps(engine, "gpt2", 0, 1)
    engine.save_checkpoint(tmp_path / "ck")
    engine.close()
    step_dir = glob.glob(str(tmp_path / "ck" / "global_step1" / "*" / "rank-00000.json"))
    step_dir = os.path.dirname(step_dir[0]) if step_dir else str(tmp_path / "ck" / "global_step1")
    manifest = json.load(open(os.path.join(step_dir, "rank-00000.json")))
    block = next(b for b in manifest["blocks"] if b["state"] == "master32")
    for damage in ("flip", "cut"):
        bad = tmp_path / f"bad-{damage}"
        shutil.copytree(tmp_path / "ck", bad)
        bin_path = glob.glob(str(bad / "**" / "rank-00000.bin"), recursive=True)[0]
        with open(bin_path, "r+b") as f:
            if damage == "flip":
                f.seek(block["offset"] + 3)
                byte = f.read(1)
                f.seek(block["offset"] + 3)
                f.write(bytes([byte[0] ^ 0x40]))
            else:
                f.truncate(block["offset"] + 1)
        with pytest.raises(CheckpointError) as e:
            get_fp32_state_dict_from_zero_checkpoint(bad)
        assert "rank-00000.bin" in str(e.value)
        assert ("crc32c" if damage == "flip" else "is truncated") in str(e.value), str(e.value)
    # A damaged manifest is a CheckpointError too (the command line's exit 2), not a traceback
    # from json, KeyError or IndexError: cut short, a field gone, a field out of range.
    text = open(os.path.join(step_dir, "rank-00000.json")).read()
    edits = {
        "cut": lambda m: None,
        "no_world": lambda m: m.pop("world_size"),
        "huge_world": lambda m: m.__setitem__("world_size", 2**40),  # was a MemoryError
        "chunk_99": lambda m: m["layout"]["params"][0].__setitem__("chunk", 99),
        "negative_numel": lambda m: m["layout"]["chunk_numel"].__setitem__(0, -5),
        "no_params": lambda m: m["layout"].pop("params"),
        # a master block of no bytes gave that shard's weights as zeros, without a word
        "zero_bytes": lambda m: next(b for b in m["blocks"]
                                     if b["state"] == "master32").__setitem__("bytes", 0),
        "no_shard": lambda m: (m["shard_numel"].__setitem__(0, 0),
                               next(b for b in m["blocks"] if b["state"] == "master32"
                                    and b["chunk"] == 0).__setitem__("bytes", 0)),
        # checked as the engine's load checks them: a KeyError traceback, and a future format
        # converted without a word
        "no_rank": lambda m: m.pop("rank"),
        "future_version": lambda m: m.__setitem__("version", 9),
    }
    for name, edit in edits.items():
        bad = tmp_path / f"manifest-{name}"
        shutil.copytree(tmp_path / "ck", bad)
        path = glob.glob(str(bad / "**" / "rank-00000.json"), recursive=True)[0]
        if name == "cut":
            open(path, "w").write(text[:1000])
        else:
            m = json.loads(text)
            edit(m)
            open(path, "w").write(json.dumps(m))
        with pytest.raises(CheckpointError) as e:
            get_fp32_state_dict_from_zero_checkpoint(bad)
        assert "rank-00000.json" in str(e.value) or "manifest" in str(e.value), (name, str(e.value))
    assert get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ck")  # the original still loads
    # Files that are not files: a FIFO in the state file's place blocked the read for ever; a
    # `latest` of binary bytes was a UnicodeDecodeError traceback.
    fifo = tmp_path / "fifo"
    shutil.copytree(tmp_path / "ck", fifo)
    bin_path = glob.glob(str(fifo / "**" / "rank-00000.bin"), recursive=True)[0]
    os.unlink(bin_path)
    os.mkfifo(bin_path)
    with pytest.raises(CheckpointError, match="is a FIFO, not a regular file"):
        get_fp32_state_dict_from_zero_checkpoint(fifo)
    binary = tmp_path / "binary-latest"
    shutil.copytree(tmp_path / "ck", binary)
    with open(binary / "global_step1" / "latest", "wb") as f:
        f.write(b"\x00\xff garbage")
    with pytest.raises(CheckpointError, match="latest"):
        get_fp32_state_dict_from_zero_checkpoint(binary)


def test_zero_to_fp32_never_writes_over_its_own_checkpoint(tmp_path):
    """An output inside the checkpoint being converted (a rank file, a `latest`) replaced that
    file and exited 0: the checkpoint was gone. It is refused now and nothing changes; a
    missing folder above the output is made, an unwritable one is a clear exit 2, and a full disk
    (a tmpfs, where this process may mount one) leaves no partial file and no abort."""
    import glob
    import subprocess

    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
    from strata.zero_to_fp32 import CheckpointError
    cfg = harness.config_for(STAGE2_CPU, tmp_path / "nvme")
    engine = _engine("gpt2", cfg)
    harness.run_steps(engine, "gpt2", 0, 1)
    engine.save_checkpoint(tmp_path / "ck")
    engine.close()
    ck = tmp_path / "ck"
    files = sorted(glob.glob(str(ck / "**" / "*"), recursive=True))
    before = {f: open(f, "rb").read() for f in files if os.path.isfile(f)}
    step_dir = os.path.dirname(glob.glob(str(ck / "**" / "rank-00000.bin"), recursive=True)[0])
    for out in (os.path.join(step_dir, "rank-00000.bin"), os.path.join(step_dir, "rank-00000.json"),
                ck / "latest", ck / "global_step1" / "latest", step_dir):
        with pytest.raises(CheckpointError, match="a file of the checkpoint being converted"):
            convert_zero_checkpoint_to_fp32_state_dict(ck, out)
    assert {f: open(f, "rb").read() for f in before} == before
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))

    def cli(out):
        return subprocess.run([sys.executable, "-m", "deepspeed.utils.zero_to_fp32", str(ck),
                               str(out)], capture_output=True, text=True, env=env)
    made = cli(tmp_path / "new" / "folder" / "w.bin")
    assert made.returncode == 0 and (tmp_path / "new" / "folder" / "w.bin").exists(), made.stderr
    refused = cli("/proc/strata-z2f.bin")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "/proc/strata-z2f.bin" in refused.stderr, refused.stderr
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)],
                      capture_output=True).returncode != 0:
        return  # may not mount here (not root, or a container without CAP_SYS_ADMIN)
    try:
        full = cli(small / "w.bin")
        assert full.returncode == 2, full.stderr
        assert "No space left" in full.stderr and "Traceback" not in full.stderr, full.stderr
        assert os.listdir(small) == []
    finally:
        subprocess.run(["umount", "-l", str(small)])


@pytest.mark.parametrize("flag", ["load_module_only"])
def test_load_weights_only_keeps_optimizer_and_counters(flag, tmp_path):
    """Only the weights are restored; the script's client_state comes back, as DeepSpeed
    returns it (it came back None, and `client['epoch']` failed in a script)."""
    cfg = harness.config_for(STAGE2_CPU, tmp_path)
    saved = _engine("gpt2", cfg)
    harness.run_steps(saved, "gpt2", 0, 3)
    saved.save_checkpoint(tmp_path / "ck", client_state={"epoch": 7})
    want = saved.master_parameters()
    saved.close()
    other = _engine("gpt2", cfg)
    harness.run_steps(other, "gpt2", 0, 1)
    kw = {"load_module_only": True} if flag == "load_module_only" else {
        "load_optimizer_states": False}
    path, client = other.load_checkpoint(tmp_path / "ck", **kw)
    assert path is not None and client == {"epoch": 7}
    assert other.global_steps == 1  # the counters stay
    for a, b in zip(other.master_parameters(), want):
        assert torch.equal(a, b)
    harness.run_steps(other, "gpt2", 1, 1)  # and it trains on
    other.close()


@pytest.mark.parametrize("stage", [0, 2])
def test_load_without_optimizer_states_restores_counters_and_keeps_the_optimizer(stage, tmp_path):
    """DeepSpeed's load_optimizer_states=False: the weights, global_steps and the schedule come
    back, while the optimizer keeps its states and its own step count in their bias correction
    (torch's AdamW state). Strata loaded the weights alone, and its Adam counted the global
    step, so the next update differed from DeepSpeed's."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR",
                         "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                    "warmup_num_steps": 8, "warmup_type": "linear"}}}
    if stage:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(2, 4, generator=g) for _ in range(6)]

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        ref = copy.deepcopy(model)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=copy.deepcopy(cfg))
        return engine, ref

    def step(engine, x):
        lr = engine.get_lr()[0]
        engine.backward(engine(x).square().mean())
        engine.step()
        return lr

    saved, _ = build()
    for x in xs[:3]:
        step(saved, x)
    saved.save_checkpoint(tmp_path / "ck", client_state={"epoch": 7})
    want_lr, weights = saved.get_lr(), saved.master_parameters()
    saved.close()

    engine, ref = build()
    ref_opt = torch.optim.AdamW(ref.parameters(), weight_decay=0.01)
    lrs = [step(engine, xs[3])]
    path, client = engine.load_checkpoint(tmp_path / "ck", load_optimizer_states=False)
    assert client == {"epoch": 7} and engine.global_steps == 3 and engine.get_lr() == want_lr
    assert all(torch.equal(a, b) for a, b in zip(engine.master_parameters(), weights))
    lrs.append(step(engine, xs[4]))
    assert engine.global_steps == 4
    # The reference: AdamW's own state from its one step, the saved weights, the restored lr.
    for i, x in enumerate(xs[3:5]):
        if i == 1:
            with torch.no_grad():
                for p, w in zip(ref.parameters(), weights):
                    p.copy_(w)
        ref_opt.param_groups[0]["lr"] = lrs[i]
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(engine.master_parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q.detach(), rtol=1e-6, atol=1e-7)
    # A checkpoint of this run records the optimizer's own count: a resume steps bit-exactly.
    engine.save_checkpoint(tmp_path / "ck2")
    resumed, _ = build()
    resumed.load_checkpoint(tmp_path / "ck2")
    step(engine, xs[5])
    step(resumed, xs[5])
    assert all(torch.equal(a, b) for a, b in zip(resumed.master_parameters(),
                                                 engine.master_parameters()))
    engine.close()
    resumed.close()


def test_client_state_with_plain_content_loads_weights_only(tmp_path):
    engine = _engine("kwargs", harness.config_for(STAGE0, tmp_path))
    engine.save_checkpoint(tmp_path / "ck", client_state={"step": 3, "t": torch.ones(2)})
    engine.save_checkpoint(tmp_path / "ck2", client_state={"args": argparse.Namespace(a=1)})
    _, client = engine.load_checkpoint(tmp_path / "ck")
    assert client["step"] == 3 and torch.equal(client["t"], torch.ones(2))
    _, client = engine.load_checkpoint(tmp_path / "ck2")  # trusted: full unpickling
    assert client["args"].a == 1
    engine.close()


# --- initialize twice, destroy -----------------------------------------------------------------
@pytest.mark.parametrize("case", [STAGE0, STAGE3], ids=lambda c: c[0])
def test_second_initialize_with_the_same_config_returns_the_engine(case, tmp_path):
    cfg = harness.config_for(case, tmp_path)
    torch.manual_seed(0)
    model = harness.gpt2()
    first, opt, _, _ = deepspeed.initialize(model=model, config=copy.deepcopy(cfg))
    harness.run_steps(first, "gpt2", 0, 1)
    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    second, opt2, loader, _ = deepspeed.initialize(model=model, config=copy.deepcopy(cfg),
                                                   training_data=data)
    assert second is first and opt2 is opt and len(loader) == 4
    want = harness.train_strata("gpt2", cfg, 3)
    got = harness.run_steps(first, "gpt2", 1, 2)
    assert got == want[1:]
    first.close()


def test_second_initialize_with_another_config_hands_over(tmp_path):
    cfg = harness.config_for(STAGE3, tmp_path)
    torch.manual_seed(0)
    model = harness.gpt2()
    first, *_ = deepspeed.initialize(model=model, config=copy.deepcopy(cfg))
    harness.run_steps(first, "gpt2", 0, 2)
    trained = first.master_parameters()
    other = dict(cfg, gradient_clipping=0.25)
    with pytest.warns(UserWarning, match="takes over"):
        second, *_ = deepspeed.initialize(model=model, config=copy.deepcopy(other))
    assert second is not first
    for a, b in zip(second.master_parameters(), trained):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="no longer trains"):
        first.step()
    # Its forward too: the model runs under the new engine's hooks now.
    x, y = harness.batch("gpt2", 0)
    with pytest.raises(ValueError, match="no longer trains .*call the new engine"):
        first(x, targets=y)
    harness.run_steps(second, "gpt2", 2, 1)
    second.close()


def test_destroy_gives_the_model_its_weights_back(tmp_path):
    cfg = harness.config_for(STAGE3, tmp_path)
    engine = _engine("gpt2", cfg)
    harness.run_steps(engine, "gpt2", 0, 2)
    masters = engine.master_parameters()
    model = engine.module
    engine.destroy()
    for p, want in zip(model.parameters(), masters):
        assert torch.equal(p.detach(), want)
    # A plain forward works, and so does a new engine on the same model.
    x, y = harness.batch("gpt2", 5)
    assert torch.isfinite(harness.loss_of("gpt2", model, x, y))
    again, *_ = deepspeed.initialize(model=model, config=copy.deepcopy(cfg))
    harness.run_steps(again, "gpt2", 0, 1)
    again.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_destroy_after_freezing_a_layer_gives_every_weight_back(stage, tmp_path):
    """A layer frozen after initialize is still the engine's: destroy paired the masters with
    the parameters that require grad now, one short, and failed on a shape with the engine
    already closed (under stage 3 every parameter was left empty)."""
    cfg = copy.deepcopy(harness.config_for(STAGE3, tmp_path))
    cfg["zero_optimization"]["stage"] = stage
    engine = _engine("gpt2", cfg)
    harness.run_steps(engine, "gpt2", 0, 1)
    model = engine.module
    frozen = next(p for p in model.parameters())
    frozen.requires_grad_(False)
    masters = engine.master_parameters()
    engine.destroy()
    for p, want in zip(model.parameters(), masters):
        assert torch.equal(p.detach(), want)
    x, y = harness.batch("gpt2", 5)
    assert torch.isfinite(harness.loss_of("gpt2", model, x, y))


@pytest.mark.parametrize("stage", [2, 3])
def test_destroy_after_bf16_gives_buffers_and_frozen_weights_their_dtype_back(stage, tmp_path):
    """A bf16 run computes with the buffers (BatchNorm's statistics) and frozen parameters in
    bf16; destroy gave the trained parameters back in fp32 and left those in bf16, so a plain
    forward and a new fp32 engine failed on the mixed dtypes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model[2].requires_grad_(False)
    cfg = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
           "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=copy.deepcopy(cfg))
    assert model[1].running_mean.dtype == torch.bfloat16  # what the run computes with
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 4).bfloat16()).float().pow(2).mean())
        engine.step()
    engine.destroy()
    assert {n: t.dtype for n, t in model.state_dict().items()
            if t.is_floating_point()} == {n: torch.float32 for n, t in model.state_dict().items()
                                          if t.is_floating_point()}
    assert model(torch.randn(4, 4)).dtype == torch.float32
    del cfg["bf16"]
    again, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    again.backward(again(torch.randn(4, 4)).pow(2).mean())
    again.step()
    assert again.global_steps == 1
    again.destroy()


def test_initialize_on_a_model_whose_stage3_engine_was_closed_is_an_error(tmp_path):
    cfg = harness.config_for(STAGE3, tmp_path)
    engine = _engine("gpt2", cfg)
    model = engine.module
    engine.close()
    with pytest.raises(ValueError, match="has no memory"):
        deepspeed.initialize(model=model, config=copy.deepcopy(cfg))


# --- optimizer objects -------------------------------------------------------------------------
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_deepspeed_cpu_adam_trains_as_torch_adam(adamw_mode, tmp_path):
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    cfg = harness.config_for(STAGE0, tmp_path)
    del cfg["optimizer"]
    torch.manual_seed(0)
    model = harness.kwargs_net()
    ds_opt = DeepSpeedCPUAdam(model.parameters(), lr=1e-3, weight_decay=0.1, adamw_mode=adamw_mode)
    engine, *_ = deepspeed.initialize(model=model, optimizer=ds_opt, config=cfg)
    got = harness.run_steps(engine, "kwargs", 0, 4)
    engine.close()
    torch.manual_seed(0)
    ref = harness.kwargs_net()
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    opt = cls(ref.parameters(), lr=1e-3, weight_decay=0.1)
    want = []
    for step in range(4):
        x, y = harness.batch("kwargs", step)
        loss = harness.loss_of("kwargs", ref, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    harness.assert_close(got, want, rel=1e-5)
    # Outside an engine the object steps as torch's optimizer does.
    torch.manual_seed(0)
    a, b = harness.kwargs_net(), harness.kwargs_net()
    b.load_state_dict(a.state_dict())
    oa = DeepSpeedCPUAdam(a.parameters(), lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode)
    ob = cls(b.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(2):
        x, y = harness.batch("kwargs", step)
        for m, o in ((a, oa), (b, ob)):
            harness.loss_of("kwargs", m, x, y).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q)


# --- the launcher ------------------------------------------------------------------------------
def _plan(*argv):
    from strata import launcher
    return launcher.plan(launcher._parser().parse_args(list(argv) + ["train.py", "--x", "1"]))


def test_launcher_maps_deepspeed_flags():
    from strata import launcher
    args = launcher._parser().parse_args(["--num_gpus", "2", "train.py", "--deepspeed", "--lr=1"])
    assert args.user_script == "train.py" and args.user_args == ["--deepspeed", "--lr=1"]
    assert _plan("--num_gpus", "3")[0] == 3
    assert _plan()[0] == 1  # no GPU: one CPU rank
    assert _plan("--include", "localhost:0,2")[0] == 2
    assert _plan("--num_gpus", "4", "--exclude", "localhost:1")[0] == 3
    assert _plan("--num_nodes", "1", "--master_addr", "127.0.0.1", "--master_port", "1234")[0] == 1
    nproc, env = _plan("--num_gpus", "2", "--bind_cores_to_rank", "--bind_core_list", "0-3")
    assert env["STRATA_RANK_CORES"] == "0,1;2,3" and env["OMP_NUM_THREADS"] == "2"


@pytest.mark.parametrize("argv, words", [
    (["--num_nodes", "2"], "--num_nodes 2"),
    (["--master_addr", "10.1.2.3"], "--master_addr 10.1.2.3"),
    (["--include", "worker-1:0"], "worker-1"),
    (["--force_multi"], "--force_multi"),
    (["--autotuning", "run"], "--autotuning"),
    (["--include", "localhost:0", "--exclude", "localhost:1"], "exclude each other"),
    (["--master_port", "-1"], "--master_port -1: a TCP port"),  # was named as --master-port
    (["--master_port", "70000"], "--master_port 70000: a TCP port"),
])
def test_launcher_refuses_flags_it_cannot_honour(argv, words):
    from strata import launcher
    with pytest.raises(launcher.LaunchError, match=words):
        _plan(*argv)


def test_launcher_refuses_a_hostfile_naming_other_hosts(tmp_path):
    from strata import launcher
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\nworker-7 slots=8\n")
    with pytest.raises(launcher.LaunchError, match="worker-7"):
        _plan("--hostfile", str(hostfile))
    hostfile.write_text("localhost slots=3  # this machine\n")
    assert _plan("--hostfile", str(hostfile))[0] == 3
    # Malformed files are named with their line, never a traceback.
    for text in ("localhost slots=abc\n", "localhost slots=0\n",
                 "localhost slots=99999999999999999999\n", "\n\nlocalhost slots=-2\n"):
        hostfile.write_text(text)
        with pytest.raises(launcher.LaunchError, match=r"line \d+ .*slots=<n>"):
            _plan("--hostfile", str(hostfile))
    hostfile.write_bytes(b"\xff\xfe localhost")
    with pytest.raises(launcher.LaunchError, match="cannot be read as text"):
        _plan("--hostfile", str(hostfile))
    hostfile.write_text("# only a comment\n\n")
    with pytest.raises(launcher.LaunchError, match="lists no hosts"):
        _plan("--hostfile", str(hostfile))
    with pytest.raises(launcher.LaunchError, match="/dev/null: not a regular file"):
        _plan("--hostfile", "/dev/null")  # was "no such file"
    with pytest.raises(launcher.LaunchError, match="no such file"):
        _plan("--hostfile", str(tmp_path / "missing"))


@pytest.mark.parametrize("argv", [["--include", "localhost:-1"], ["--include", "localhost:"],
                                  ["--include", "localhost:0,0"], ["--exclude", "localhost:x"],
                                  ["--bind_cores_to_rank", "--bind_core_list", "abc"],
                                  ["--bind_cores_to_rank", "--bind_core_list", "3-1"]])
def test_launcher_names_malformed_slots_and_cores(argv):
    from strata import launcher
    with pytest.raises(launcher.LaunchError, match="slots must be distinct integers|cores are"):
        _plan(*argv)


def test_deepspeed_command_names_a_bad_flag():
    import subprocess
    out = subprocess.run([harness.deepspeed_command(), "--num_nodes", "2", "x.py"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "--num_nodes 2" in out.stderr
    helped = subprocess.run([harness.deepspeed_command(), "--help"],
                            capture_output=True, text=True)
    assert helped.returncode == 0 and "--num_gpus" in helped.stdout


# --- Hugging Face's Trainer path, by its calls -------------------------------------------------
def test_the_calls_the_trainer_makes_through_accelerate(tmp_path):
    """The calls transformers' Trainer makes through accelerate's DeepSpeed path (both the
    optimizer and the scheduler from the config), in its order: detection by distribution
    metadata, initialize with config_params and model_parameters, then per micro-batch
    set_gradient_accumulation_boundary + backward(loss / GAS, scale_wrt_gas=False) and step at
    the boundary, the grad norm, zero_grad, a checkpoint save and resume, the 16-bit state dict,
    destroy and a second train(). Compared with plain PyTorch doing the same arithmetic."""
    import importlib.util
    assert importlib.util.find_spec("deepspeed") is not None
    assert importlib.metadata.metadata("deepspeed")["Name"] == "deepspeed"
    gas, steps = 2, 3
    cfg = harness.config_for(STAGE3, tmp_path, gradient_accumulation_steps=gas)
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    torch.manual_seed(0)
    model = harness.gpt2()
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, config_params=copy.deepcopy(cfg),
        model_parameters=[p for p in model.parameters() if p.requires_grad])
    assert isinstance(engine, deepspeed.DeepSpeedEngine) and engine.module is model
    assert engine.config.get("zero_optimization", {}).get("stage") == 3
    torch.manual_seed(0)
    ref = harness.gpt2()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=harness.LR, weight_decay=harness.WEIGHT_DECAY)
    norms = []
    for step in range(steps):
        for m in range(gas):
            x, y = harness.batch("gpt2", step * gas + m)
            boundary = m == gas - 1
            engine.set_gradient_accumulation_boundary(boundary)
            loss = harness.loss_of("gpt2", engine, x, y) / gas   # the Trainer divides itself
            engine.backward(loss, scale_wrt_gas=False)
            if boundary:
                engine.step()
            (harness.loss_of("gpt2", ref, x, y) / gas).backward()
        norms.append(engine.get_global_grad_norm())
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")).item()
        assert norms[-1] == pytest.approx(want, rel=1e-4)
        ref_opt.step()
        ref_opt.zero_grad()
        engine.zero_grad()
    for (name, p), got in zip(ref.named_parameters(), engine.master_parameters()):
        # The key bias is left out (harness.without_key_bias); the loss check below covers it.
        torch.testing.assert_close(harness.without_key_bias(name, got),
                                   harness.without_key_bias(name, p.detach()),
                                   rtol=1e-5, atol=1e-6, msg=name)
    x, y = harness.batch("gpt2", 50)
    with torch.no_grad():
        held_out = harness.loss_of("gpt2", engine, x, y).item()
        assert held_out == pytest.approx(harness.loss_of("gpt2", ref, x, y).item(), rel=1e-5)
    # _save_checkpoint: the 16-bit weights for save_pretrained, then the engine checkpoint.
    state = engine._zero3_consolidated_16bit_state_dict()
    plain = harness.gpt2()
    plain.load_state_dict(state, strict=True)
    engine.save_checkpoint(str(tmp_path / "checkpoint-3"))
    # Resume in a new engine (deepspeed_load_checkpoint), then destroy and a second train().
    torch.manual_seed(1)
    other = harness.gpt2()
    resumed, *_ = deepspeed.initialize(model=other, config_params=copy.deepcopy(cfg),
                                       model_parameters=list(other.parameters()))
    path, _ = resumed.load_checkpoint(str(tmp_path / "checkpoint-3"), load_module_strict=True,
                                      load_optimizer_states=True, load_lr_scheduler_states=True)
    assert path is not None and resumed.global_steps == steps
    for a, b in zip(resumed.master_parameters(), engine.master_parameters()):
        assert torch.equal(a, b)
    engine.destroy()
    resumed.destroy()
    again, *_ = deepspeed.initialize(model=model, config_params=copy.deepcopy(cfg),
                                     model_parameters=list(model.parameters()))
    x, y = harness.batch("gpt2", 99)
    again.backward(harness.loss_of("gpt2", again, x, y))
    again.close()


def test_nvme_dir_removed_before_close_is_a_normal_exit(tmp_path, capfd):
    import shutil
    nvme = tmp_path / "nvme"
    engine = _engine("gpt2", harness.config_for(STAGE3_NVME, nvme))
    harness.run_steps(engine, "gpt2", 0, 1, 2)
    shutil.rmtree(nvme)  # a temporary nvme_path cleaned up before the engine goes
    engine.close()
    err = capfd.readouterr().err
    assert "[strata E" not in err, err
    assert "was removed; no index written" in err


def test_the_trainers_default_path_two_groups_and_its_own_scheduler(tmp_path):
    """The Trainer with neither optimizer nor scheduler in the DeepSpeed config (its default):
    it builds AdamW with two groups (weight decay 0.01 on matrices, 0 on biases and norms),
    passes it to initialize, builds its LambdaLR (linear warmup then decay) on that AdamW, and at
    each boundary steps the engine, reads the grad norm and optimizer.overflow, then steps the
    LambdaLR itself. Compared with plain PyTorch doing the same (clipping at 1.0, GAS 2)."""
    gas, steps, warmup = 2, 4, 2
    cfg = harness.config_for(STAGE3, tmp_path, gradient_accumulation_steps=gas,
                             gradient_clipping=1.0)
    del cfg["optimizer"]

    def trainer_optimizer(model):
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=harness.LR)

    def trainer_schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: (s + 1) / warmup if s < warmup else max(0.0, (steps - s) / (steps - warmup)))

    torch.manual_seed(0)
    model = harness.gpt2()
    client = trainer_optimizer(model)
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=client,
                                                           config_params=copy.deepcopy(cfg))
    assert scheduler is None and optimizer.param_groups is client.param_groups
    lr_scheduler = trainer_schedule(client)
    losses, lrs = [], []
    for step in range(steps):
        total = 0.0
        for m in range(gas):
            x, y = harness.batch("gpt2", step * gas + m)
            boundary = m == gas - 1
            engine.set_gradient_accumulation_boundary(boundary)
            loss = harness.loss_of("gpt2", engine, x, y) / gas
            engine.backward(loss, scale_wrt_gas=False)
            if boundary:
                engine.step()
            total += loss.item()
        assert engine.get_global_grad_norm() is not None
        assert optimizer.overflow is False
        lrs.append(lr_scheduler.get_last_lr()[0])
        lr_scheduler.step()  # the Trainer's own step, on its AdamW
        engine.zero_grad()
        losses.append(total)
    assert lrs == pytest.approx([harness.LR / 2, harness.LR, harness.LR, harness.LR / 2])
    torch.manual_seed(0)
    ref = harness.gpt2()
    ref_opt = trainer_optimizer(ref)
    want = harness.reference_loop("gpt2", ref, ref_opt, steps, gas, 1.0,
                                  sched=trainer_schedule(ref_opt))
    harness.assert_close(losses, want)
    engine.destroy()
