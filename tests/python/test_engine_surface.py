"""The engine's public surface against DeepSpeed's: every public name of DeepSpeedEngine
(tests/data/deepspeed-engine-names.txt, read from DeepSpeed 0.19.6's source) has a row in
strata/engine_surface.py; a walk over the table calls every implemented row on a live engine
and reads every refused one; the values the issue names are checked against what the run
really is (its config, its data, plain PyTorch's model)."""

import copy
import inspect
import os
import sys

import pytest
import torch

import harness
import strata
from strata import engine_surface as surface
from strata import unsupported

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
NAMES = os.path.join(ROOT, "tests", "data", "deepspeed-engine-names.txt")


def _deepspeed_names():
    with open(NAMES) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def test_every_deepspeed_name_has_a_row_and_no_row_is_invented():
    names = _deepspeed_names()
    assert len(names) > 250, len(names)
    missing = [n for n in names if n not in surface.ROWS]
    assert not missing, f"DeepSpeed names without a row: {missing}"
    invented = [n for n in surface.ROWS if n not in set(names)]
    assert not invented, f"rows that are not DeepSpeed's: {invented}"
    for row in surface.ROWS.values():
        assert row.status in (surface.SAME, surface.DIFFERS, surface.REFUSED), row
        if row.status == surface.REFUSED:
            assert row.note in unsupported.FEATURES, row
        elif row.status == surface.DIFFERS:
            assert row.note, f"{row.name}: a 'differs' row must say how"


def test_the_markdown_table_is_current():
    with open(os.path.join(ROOT, "python", "ENGINE_SURFACE.md")) as f:
        assert f.read() == surface.markdown(), \
            "regenerate: python3 -m strata.engine_surface > python/ENGINE_SURFACE.md"


class Greeter(torch.nn.Module):
    """gpt2 with a method of its own, reached through the engine as DeepSpeed's forwarding does."""

    def __init__(self):
        super().__init__()
        self.net = harness.gpt2()

    def forward(self, x, targets=None):
        return self.net(x, targets=targets)

    def greet(self, who):
        return f"hello {who}"


DATA = torch.utils.data.TensorDataset(torch.randint(0, 256, (12, 16)),
                                      torch.randint(0, 256, (12, 16)))
CASES = {"stage0": next(c for c in harness.GRID if c[0] == "stage0"),
         "stage3_cpu_release": next(c for c in harness.GRID if c[0] == "stage3_cpu_release")}


def _engine(case, tmp_path, **extra):
    torch.manual_seed(0)
    model = Greeter()
    cfg = harness.config_for(case, tmp_path / "nvme", **extra)
    engine, _, loader, _ = strata.initialize(model=model, model_parameters=model.parameters(),
                                             config=copy.deepcopy(cfg), training_data=DATA)
    return engine, loader, cfg


def _calls(engine, tmp_path, env):
    """How to call the rows that need arguments, in table order (forward, backward, step first)."""
    x, y = harness.batch("gpt2", 0)

    def forward():
        env["loss"] = engine(x, targets=y)
        return env["loss"]

    def offload_states():
        if engine.zero_optimization_stage() < 3:
            with pytest.raises(strata.StrataError, match="stage 3"):
                engine.offload_states()
            return "refused below stage 3"
        engine.offload_states()
        return "offloaded"

    def reload_states():
        if engine.zero_optimization_stage() >= 3:
            engine.reload_states()

    return {
        "forward": forward,
        "backward": lambda: engine.backward(env["loss"]),
        "set_gradient_accumulation_boundary":
            lambda: engine.set_gradient_accumulation_boundary(True),
        "offload_states": offload_states,
        "reload_states": reload_states,
        "deepspeed_io": lambda: engine.deepspeed_io(DATA, route="eval"),
        "is_map_style_dataset": lambda: engine.is_map_style_dataset(DATA),
        "is_iterable_style_dataset": lambda: engine.is_iterable_style_dataset(DATA),
        "save_checkpoint": lambda: engine.save_checkpoint(str(tmp_path / "ckpt")),
        "load_checkpoint": lambda: engine.load_checkpoint(str(tmp_path / "ckpt")),
        "save_16bit_model": lambda: engine.save_16bit_model(str(tmp_path / "w16")),
        "save_fp16_model": lambda: engine.save_fp16_model(str(tmp_path / "w16b")),
        "load_module_state_dict":
            lambda: engine.load_module_state_dict({"module": engine.module_state_dict()}),
        "destroy": lambda: None,  # last, below
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_walk_the_table(case, tmp_path):
    engine, _, _ = _engine(CASES[case], tmp_path)
    env = {}
    calls = _calls(engine, tmp_path, env)
    called = []
    for row in surface.ROWS.values():
        if row.status == surface.REFUSED:
            with pytest.raises(unsupported.NotSupportedError) as e:
                getattr(engine, row.name)
            what, instead = unsupported.FEATURES[row.note]
            assert f"engine.{row.name}" in str(e.value) and instead in str(e.value), str(e.value)
            assert isinstance(e.value, AttributeError)
            assert not hasattr(engine, row.name)
            continue
        value = getattr(engine, row.name)
        if row.name in calls:
            calls[row.name]()
        elif row.kind in ("method", "staticmethod"):
            assert callable(value), row.name
            value()
        called.append(row.name)
    assert env["loss"] is not None and engine.global_steps == 1
    engine.destroy()
    implemented = [r.name for r in surface.ROWS.values() if r.status != surface.REFUSED]
    assert called == implemented


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_names_the_issue_lists(case, tmp_path):
    engine, loader, cfg = _engine(CASES[case], tmp_path, gradient_accumulation_steps=2)
    model = engine.module
    assert isinstance(model, Greeter)
    assert engine.dp_world_size == 1 and engine.mp_world_size == 1 and engine.global_rank == 0
    assert engine.train_micro_batch_size_per_gpu() == 2
    assert engine.gradient_accumulation_steps() == 2
    assert engine.train_batch_size() == 4
    assert engine.zero_optimization_stage() == cfg["zero_optimization"]["stage"]
    # zero_offload_*: DeepSpeed's section objects (truthy) or None.
    want_optim = cfg["zero_optimization"]["offload_optimizer"]["device"]
    assert engine.zero_offload_optimizer().device == want_optim
    assert engine.zero_offload_param().device == cfg["zero_optimization"]["offload_param"]["device"]
    # The loader: initialize's, kept as training_dataloader, micro-batches of 2, 12 samples.
    assert engine.training_dataloader is loader
    assert sum(len(b[0]) for b in loader) == len(DATA) and next(iter(loader))[0].shape[0] == 2
    eval_loader = engine.deepspeed_io(DATA, batch_size=3, route="eval")
    first = next(iter(eval_loader))[0]
    assert torch.equal(first, DATA.tensors[0][:3])  # eval: in order, not shuffled
    engine.training_dataloader = eval_loader  # assignable, as DeepSpeed's scripts do
    assert engine.training_dataloader is eval_loader
    # Steps, samples, micro-steps and the boundary over two accumulation steps.
    assert engine.global_steps == 0 and engine.micro_steps == 0
    for micro in range(4):
        x, y = harness.batch("gpt2", micro)
        loss = engine(x, targets=y)
        engine.backward(loss)
        assert engine.is_gradient_accumulation_boundary() == (micro % 2 == 1)
        engine.step()
    assert engine.global_steps == 2 and engine.micro_steps == 4
    assert engine.global_samples == 2 * engine.train_batch_size()
    assert engine.get_lr() == [harness.LR]
    assert engine.get_mom() == [(0.9, 0.999)]  # AdamW's default betas, as the config leaves them
    # eval()/train() reach the model.
    engine.eval()
    assert not model.training and not model.net.training
    engine.train()
    assert model.training
    # load_checkpoint takes DeepSpeed's keywords.
    ds_keywords = ["load_dir", "tag", "load_module_strict", "load_optimizer_states",
                   "load_lr_scheduler_states", "load_module_only", "custom_load_fn"]
    assert list(inspect.signature(engine.load_checkpoint).parameters) == ds_keywords
    # save_fp16_model is save_16bit_model: the file holds the model's weights.
    assert engine.save_fp16_model(str(tmp_path / "w"), "m.bin") in (True, False)
    if engine.zero_optimization_stage() < 3:
        saved = torch.load(str(tmp_path / "w" / "m.bin"))
        masters = dict(zip([n for n, _ in model.named_parameters()], engine.master_parameters()))
        for name, value in saved.items():
            if name in masters:
                assert torch.allclose(value.float(), masters[name], atol=1e-6), name
    # A model's own method through the engine; an unknown name says where to look.
    assert engine.greet("you") == "hello you"
    with pytest.raises(AttributeError, match="ENGINE_SURFACE"):
        engine.no_such_name
    engine.close()


def test_config_getters_report_the_config(tmp_path):
    case = CASES["stage3_cpu_release"]
    engine, _, _ = _engine(case, tmp_path, steps_per_print=7, dataloader_drop_last=True,
                           fp16={"enabled": False, "initial_scale_power": 12, "hysteresis": 3},
                           scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 5}})
    z = engine.config["zero_optimization"]
    assert engine.zero_param_persistence_threshold() == 0  # the case sets it
    assert engine.zero_max_reuse_distance() == 0
    assert engine.zero_reduce_bucket_size() == z.get("reduce_bucket_size", 5 * 10**8)
    assert engine.zero_sub_group_size() == 10**9  # DeepSpeed's default, the case leaves it out
    assert engine.zero_optimization() and engine.zero_optimization_partition_weights()
    assert engine.zero_use_cpu_optimizer() and engine.zero_cpu_offload()
    assert not engine.zero_nvme_offload_optimizer()
    assert engine.steps_per_print() == 7 and engine.dataloader_drop_last() is True
    assert engine.initial_dynamic_scale() == 2**12
    assert engine.dynamic_loss_scale_args()["delayed_shift"] == 3
    assert engine.loss_scale() == 0 and engine.dynamic_loss_scale()
    assert engine.optimizer_name() == "AdamW" and engine.scheduler_name() == "WarmupLR"
    assert engine.scheduler_params() == {"warmup_num_steps": 5}
    assert engine.get_data_types() == (torch.float32, torch.float32)
    assert engine.communication_data_type == torch.float32
    with pytest.raises(unsupported.NotSupportedError, match="fp32"):
        engine.communication_data_type = torch.bfloat16
    engine.close()


def test_module_state_dict_round_trip_reaches_the_master(tmp_path):
    """load_module_state_dict writes the fp32 master (what the optimizer steps), not only the
    model's tensors: after loading doubled weights, master_parameters() are doubled."""
    engine, _, _ = _engine(CASES["stage3_cpu_release"], tmp_path)
    before = [m.clone() for m in engine.master_parameters()]
    sd = engine.module_state_dict()
    names = [n for n, _ in engine.module.named_parameters()]
    assert set(names) <= set(sd)
    doubled = {k: v * 2 for k, v in sd.items()}
    engine.load_module_state_dict({"module": doubled})
    after = engine.master_parameters()
    for name, b, a in zip(names, before, after):
        assert torch.allclose(a, b * 2, atol=1e-6), name
    # A bare state_dict (DeepSpeed's takes the checkpoint dict too) is refused by name, with
    # nothing loaded.
    for wrong in (doubled, [1, 2]):
        with pytest.raises(strata.InvalidArgumentError, match=r"pass \{'module': state_dict\}"):
            engine.load_module_state_dict(wrong)
    for name, b, a in zip(names, after, engine.master_parameters()):
        assert torch.equal(a, b), name
    engine.close()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
