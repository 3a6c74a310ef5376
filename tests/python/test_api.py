"""The DeepSpeed-style API around the engine: checkpoints, errors, gathered parameters,
activation checkpointing, optimizer objects and data loaders."""

import copy
import json
import math
import os
import re

import pytest
import torch

import harness
import strata

STAGE3_NVME = next(c for c in harness.GRID if c[0] == "stage3_nvme_clip_accum")
STAGE3_RELEASE = next(c for c in harness.GRID if c[0] == "stage3_cpu_release")
STAGE2_CPU = next(c for c in harness.GRID if c[0] == "stage2_cpu_clip")


def _storage_bytes(t):
    if hasattr(t, "untyped_storage"):  # torch 2.x
        return t.untyped_storage().nbytes()
    return t.storage().nbytes()


def _run(engine, model_name, first, count, accum=1):
    return harness.run_steps(engine, model_name, first, count, accum)


def _engine(model_name, cfg, model=None):
    torch.manual_seed(0)
    model = model if model is not None else harness.MODELS[model_name]()
    engine, *_ = strata.initialize(model=model, config=copy.deepcopy(cfg))
    return engine


@pytest.mark.parametrize("case", [STAGE3_NVME, STAGE2_CPU], ids=lambda c: c[0])
def test_checkpoint_round_trip_is_bit_exact(case, tmp_path):
    cfg = harness.config_for(case, tmp_path / "nvme")
    accum = cfg["gradient_accumulation_steps"]
    straight = _engine("gpt2", cfg)
    uninterrupted = _run(straight, "gpt2", 0, 5, accum)
    straight.close()

    first = _engine("gpt2", cfg)
    _run(first, "gpt2", 0, 3, accum)
    first.save_checkpoint(tmp_path / "ckpt", client_state={"data_step": 3, "note": "x"})
    first.close()

    resumed = _engine("gpt2", cfg)
    path, client = resumed.load_checkpoint(tmp_path / "ckpt")
    assert path is not None and client == {"data_step": 3, "note": "x"}
    assert resumed.global_steps == 3
    after = _run(resumed, "gpt2", 3, 2, accum)
    assert after == uninterrupted[3:]  # bit for bit
    resumed.close()


def test_tagged_checkpoint_and_latest(tmp_path):
    cfg = harness.config_for(STAGE2_CPU, tmp_path)
    engine = _engine("kwargs", cfg)
    _run(engine, "kwargs", 0, 1)
    engine.save_checkpoint(tmp_path / "ck", tag="first")
    _run(engine, "kwargs", 1, 1)
    engine.save_checkpoint(tmp_path / "ck", tag="second", client_state={"k": 2})
    engine.close()
    other = _engine("kwargs", cfg)
    assert other.load_checkpoint(tmp_path / "nothing-here") == (None, None)
    path, client = other.load_checkpoint(tmp_path / "ck")
    assert path.endswith("second") and client == {"k": 2} and other.global_steps == 2
    path, client = other.load_checkpoint(tmp_path / "ck", tag="first")
    assert path.endswith("first") and other.global_steps == 1
    with pytest.raises(ValueError, match="no checkpoint tagged 'third'"):
        other.load_checkpoint(tmp_path / "ck", tag="third")
    # One checkpoint's own directory loads, as strata-train --resume takes it (it gave
    # (None, None) and training started over); a directory with none says so, as DeepSpeed does.
    step_dir = tmp_path / "ck" / "second" / "step-00000002"
    assert (step_dir / "rank-00000.json").is_file()
    path, client = other.load_checkpoint(step_dir)
    assert path == str(step_dir) and client == {"k": 2} and other.global_steps == 2
    with StrataWarnings() as records:
        assert other.load_checkpoint(tmp_path / "nothing-here") == (None, None)
    assert any("holds no 'latest' file" in r.getMessage() for r in records)
    # A tag is one folder name inside the directory: '..' wrote over another run's `latest`, an
    # absolute tag at the file system's root.
    for tag in ("..", str(tmp_path / "abs"), "", ".", "a/b", "nul\0x"):
        with pytest.raises(ValueError, match="a tag is one folder name"):
            other.save_checkpoint(tmp_path / "ck", tag=tag)
        with pytest.raises(ValueError, match="a tag is one folder name"):
            other.load_checkpoint(tmp_path / "ck", tag=tag)
    assert not (tmp_path / "abs").exists() and not (tmp_path / "latest").exists()
    assert not (tmp_path / "ck" / "nul").exists()
    assert (tmp_path / "ck" / "latest").read_text() == "second"
    # `latest` itself, and tags that `latest` would read back as others ("v1 " as "v1").
    for tag in ("latest", "second ", " second", "\tx"):
        with pytest.raises(ValueError, match="'latest' is the file that names the last tag"):
            other.save_checkpoint(tmp_path / "ck", tag=tag)
    assert (tmp_path / "ck" / "latest").read_text() == "second"
    # A `latest` that is not text is named, not a UnicodeDecodeError.
    (tmp_path / "ck" / "latest").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="should be a text file naming the last saved tag"):
        other.load_checkpoint(tmp_path / "ck")
    other.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_of_other_shapes_is_refused(stage, tmp_path):
    """Two layers swapped, or one weight transposed (the same names and sizes), lie at the same
    offsets of the same chunks: such a checkpoint loaded without a word. It is refused, naming
    the parameter and both shapes."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}

    def engine_of(*layers):
        torch.manual_seed(0)
        engine, *_ = strata.initialize(model=torch.nn.Sequential(*layers),
                                       config=copy.deepcopy(cfg))
        return engine

    saved = engine_of(torch.nn.Linear(4, 6), torch.nn.Linear(6, 4))
    saved.save_checkpoint(tmp_path / "swapped")
    saved.close()
    saved = engine_of(torch.nn.Linear(4, 6, bias=False))
    saved.save_checkpoint(tmp_path / "transposed")
    saved.close()
    cases = [((torch.nn.Linear(6, 4), torch.nn.Linear(4, 6)), "swapped",
              "'0.weight' of shape [6, 4] there and '0.weight' of shape [4, 6] here"),
             ((torch.nn.Linear(6, 4, bias=False),), "transposed",
              "'0.weight' of shape [6, 4] there and '0.weight' of shape [4, 6] here")]
    for layers, name, message in cases:
        other = engine_of(*layers)
        with pytest.raises(ValueError, match=re.escape(message) + ".*belongs to another model"):
            other.load_checkpoint(tmp_path / name)
        other.close()


def test_a_complex_parameter_is_refused_and_float64_ones_are_named(capfd):
    """A complex parameter was cast to its real part at initialize and trained so; an fp64 model
    trains in fp32 without a word, and its fp64 inputs then failed in the first matmul."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    model = torch.nn.Linear(4, 2)
    model.phase = torch.nn.Parameter(torch.tensor([1 + 2j, 3 - 4j]))
    with pytest.raises(ValueError, match="parameter 'phase' is ComplexFloat: the engine trains "
                                         "real floating-point parameters"):
        strata.initialize(model=model, config=copy.deepcopy(cfg))
    engine, *_ = strata.initialize(model=torch.nn.Linear(4, 2).double(), config=copy.deepcopy(cfg))
    assert "2 parameter(s) are float64 (the first 'weight')" in capfd.readouterr().err
    loss = engine(torch.randn(2, 4)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.close()


@pytest.mark.parametrize("case", [STAGE2_CPU, STAGE3_RELEASE, STAGE3_NVME], ids=lambda c: c[0])
def test_a_save_after_forwards_alone_is_taken_and_refused_after_a_backward(case, tmp_path):
    """A forward outside torch.no_grad() opens the step, and a save was then refused until a
    backward and Step() had run; DeepSpeed takes it. A checkpoint holds what the last Step left,
    which forwards do not change, so the save is taken between a forward and its backward: the
    run goes on as plain PyTorch's, and a resume from that save is bit-exact. Once a backward has
    run in the step, its gradients would be missing from the checkpoint: refused, saying so."""
    cfg = harness.config_for(case, tmp_path / "nvme")
    accum = cfg["gradient_accumulation_steps"]
    want, _ = harness.train_reference("gpt2", 3, accum=accum, clip=case[5])
    engine = _engine("gpt2", cfg)
    got = _run(engine, "gpt2", 0, 1, accum)
    harness.loss_of("gpt2", engine, *harness.batch("gpt2", 99))  # evaluation, autograd on
    total = 0.0
    for m in range(accum):
        loss = harness.loss_of("gpt2", engine, *harness.batch("gpt2", accum + m))
        if m == 0:
            engine.save_checkpoint(tmp_path / "ck")  # the forward's graph stays usable
        engine.backward(loss)
        if m + 1 < accum:
            with pytest.raises(strata.StrataError, match=rf"SaveCheckpoint during a step: backward "
                                                         rf"ran since the last Step\(\) \(1 of "
                                                         rf"{accum} micro-steps\)"):
                engine.save_checkpoint(tmp_path / "ck2")
        engine.step()
        total += loss.item() / accum
    got += [total] + _run(engine, "gpt2", 2, 1, accum)
    harness.assert_close(got, want)
    loss = harness.loss_of("gpt2", engine, *harness.batch("gpt2", 3 * accum))
    engine.backward(loss)
    if accum == 1:
        with pytest.raises(strata.StrataError, match=r"backward ran since the last Step\(\) "
                                                     r"\(1 of 1 micro-steps\).*holds no gradients"):
            engine.save_checkpoint(tmp_path / "ck2")
    with pytest.raises(strata.StrataError, match=r"LoadCheckpoint during a step: a training forward "
                                                 r"\(autograd on\).*under torch\.no_grad\(\)"):
        engine.load_checkpoint(tmp_path / "ck")
    engine.close()

    resumed = _engine("gpt2", cfg)
    resumed.load_checkpoint(tmp_path / "ck")
    assert resumed.global_steps == 1
    assert _run(resumed, "gpt2", 1, 2, accum) == got[1:]  # bit for bit
    resumed.close()


def test_saving_a_tag_another_run_saved_replaces_it(tmp_path):
    """A save into a tag that already held this step from another run printed nothing and kept
    the other run's weights (the step's manifest existed, so nothing was written); DeepSpeed
    writes its files over the tag's. The save now replaces the step, and a load gives the new
    run's masters."""
    cfg = harness.config_for(STAGE2_CPU, tmp_path / "nvme")
    other = copy.deepcopy(cfg)
    other["optimizer"]["params"]["lr"] = 0.05
    masters = []
    for c in (cfg, other):
        engine = _engine("gpt2", c)
        _run(engine, "gpt2", 0, 1)
        engine.save_checkpoint(tmp_path / "ck", tag="best")
        masters.append([t.clone() for t in engine.master_parameters()])
        engine.close()
    assert not all(torch.equal(a, b) for a, b in zip(*masters))
    loaded = _engine("gpt2", cfg)
    loaded.load_checkpoint(tmp_path / "ck", tag="best")
    assert all(torch.equal(a, b) for a, b in zip(loaded.master_parameters(), masters[1]))
    loaded.close()
    assert not [p.name for p in (tmp_path / "ck" / "best").iterdir()
                if p.name.startswith(".") and p.name != ".strata-save.lock"]


def test_saving_under_one_tag_keeps_one_checkpoint(tmp_path):
    """A script saving under a fixed tag ("last") each epoch kept every step's folder in the
    tag (the engine names each after its step), so the disk filled; DeepSpeed keeps one
    checkpoint per tag. The older steps go once the new one is named, and it loads."""
    cfg = harness.config_for(STAGE2_CPU, tmp_path / "nvme")
    engine = _engine("gpt2", cfg)
    for step in range(3):
        _run(engine, "gpt2", step, 1)
        engine.save_checkpoint(tmp_path / "ck", tag="last", client_state={"step": step})
    want = [t.clone() for t in engine.master_parameters()]
    engine.close()
    steps = sorted(p.name for p in (tmp_path / "ck" / "last").iterdir()
                   if p.name.startswith("step-"))
    assert steps == ["step-00000003"]
    loaded = _engine("gpt2", cfg)
    _, client = loaded.load_checkpoint(tmp_path / "ck")
    assert client == {"step": 2} and loaded.global_steps == 3
    assert all(torch.equal(a, b) for a, b in zip(loaded.master_parameters(), want))
    loaded.close()


def test_a_save_into_a_root_another_process_is_saving_into_is_refused(tmp_path):
    """Two runs saving into one root removed each other's temporary folders, and the loser failed
    with ENOENT on a file it had just written. The root's lock is held for the whole save: a
    second saver (here this test, holding it) is refused at once, naming the root, and nothing
    of the first is touched."""
    import fcntl

    cfg = harness.config_for(STAGE2_CPU, tmp_path / "nvme")
    engine = _engine("gpt2", cfg)
    _run(engine, "gpt2", 0, 1)
    root = tmp_path / "ck" / "t"
    root.mkdir(parents=True)
    (root / ".step-00000001.tmp").mkdir()  # the other saver's folder, being written
    with open(root / ".strata-save.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(strata.StrataError, match=r"another process is saving into .*/ck/t"):
            engine.save_checkpoint(tmp_path / "ck", tag="t")
        assert (root / ".step-00000001.tmp").is_dir()
    engine.save_checkpoint(tmp_path / "ck", tag="t")  # once it is released
    assert (root / "step-00000001" / "rank-00000.json").is_file()
    engine.close()


def test_a_config_file_read_while_another_rank_rewrites_it_is_read_again(tmp_path):
    """DeepSpeed's own test scripts have every rank write /tmp/temp_config.json just before
    initialize; a rank that read it mid-rewrite (empty) was refused as "not JSON". A file that
    does not parse is read again for about a second; one that stays broken is still refused."""
    import json
    import threading

    cfg = harness.config_for(STAGE2_CPU, tmp_path / "nvme")
    path = tmp_path / "c.json"
    path.write_text("")
    writer = threading.Timer(0.3, lambda: path.write_text(json.dumps(cfg)))
    writer.start()
    engine, *_ = strata.initialize(model=harness.MODELS["gpt2"](), config=str(path))
    writer.join()
    engine.close()
    path.write_text('{"train_micro_batch_size_per_gpu": 2,')
    with pytest.raises(strata.InvalidArgumentError, match="not JSON"):
        strata.initialize(model=harness.MODELS["gpt2"](), config=str(path))


class StrataWarnings:
    """The 'strata' logger's records of WARNING and above inside the block."""

    def __enter__(self):
        import logging

        self.records = []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = self.records.append
        logging.getLogger("strata").addHandler(self.handler)
        return self.records

    def __exit__(self, *exc):
        import logging

        logging.getLogger("strata").removeHandler(self.handler)
        return False


@pytest.mark.parametrize("bad, words", [
    ({"zero_optimization": {"stage": 3, "stage3_max_live_params": 1}}, "stage3_max_live_parameters"),
    ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, "lr"),
    ({"train_micro_batch_size_per_gpu": 2, "train_batch_size": 3}, "train_batch_size"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": float("nan")}}},
     r"optimizer\.params\.lr is nan"),
    ({"gradient_clipping": float("inf")}, "gradient_clipping is inf; give a finite number"),
])
def test_bad_config_raises_value_error_naming_the_key(bad, words):
    model = harness.kwargs_net()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=words) as info:
        strata.initialize(model=model, config=bad)
    assert isinstance(info.value, strata.StrataError)
    # Nothing was taken: the model is intact and still trains with plain PyTorch.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_steps_per_print_inf_means_never_as_accelerate_writes_it():
    # accelerate sets steps_per_print = float("inf") in every config it passes to initialize.
    engine, *_ = strata.initialize(model=harness.kwargs_net(),
                                   config={"steps_per_print": float("inf"),
                                           "optimizer": {"type": "AdamW",
                                                         "params": {"lr": 1e-3}}})
    assert engine.config["steps_per_print"] == 2**63 - 1
    engine.close()


def test_missing_config_file_and_wrong_optimizer(tmp_path):
    with pytest.raises(ValueError, match="no-such.json"):
        strata.initialize(model=harness.kwargs_net(), config=str(tmp_path / "no-such.json"))
    model = harness.kwargs_net()
    # At stage 0 any torch optimizer runs itself, as with DeepSpeed (test_client_optimizer); above
    # it, one Strata does not run is refused naming its own set and the setting that allows it.
    with pytest.raises(ValueError, match="RMSprop.*Adam, AdamW, SGD, Adagrad and Lion.*"
                                         "zero_allow_untested_optimizer"):
        strata.initialize(model=model, optimizer=torch.optim.RMSprop(model.parameters(), lr=0.1),
                          config={"zero_optimization": {"stage": 2}})


def test_optimizer_object_equals_config_section(tmp_path):
    cfg = harness.config_for(STAGE2_CPU, tmp_path)
    by_config = _run(_engine("kwargs", cfg), "kwargs", 0, 4)
    no_opt = {k: v for k, v in cfg.items() if k != "optimizer"}
    torch.manual_seed(0)
    model = harness.kwargs_net()
    opt = torch.optim.AdamW(model.parameters(), lr=harness.LR, weight_decay=harness.WEIGHT_DECAY)
    engine, optimizer, _, _ = strata.initialize(model=model, optimizer=opt, config=no_opt)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(harness.LR)
    # The returned optimizer reads the client's own groups: a scheduler on `opt` moves its lr.
    assert optimizer.param_groups is opt.param_groups
    assert _run(engine, "kwargs", 0, 4) == by_config
    engine.close()


def test_gathered_parameters_reads_released_units(tmp_path):
    engine = _engine("gpt2", harness.config_for(STAGE3_RELEASE, tmp_path))
    _run(engine, "gpt2", 0, 2)
    model = engine.module
    w = model.blocks[1].fc.weight
    assert _storage_bytes(w) == 0  # released: no memory outside the unit's forward and backward
    masters = engine.master_parameters()
    index = [i for i, p in enumerate(model.parameters()) if p is w][0]
    with strata.zero.GatheredParameters([w]):
        assert _storage_bytes(w) > 0
        assert torch.equal(w.detach(), masters[index].view_as(w))
    assert _storage_bytes(w) == 0
    with pytest.raises(ValueError, match="modifier_rank"):  # writable gathers take a rank
        strata.zero.GatheredParameters([w], modifier_rank="0")
    engine.close()


def test_a_released_stage3_parameter_is_empty_as_in_deepspeed(tmp_path):
    """Between forwards a stage-3 parameter whose unit is released has 0 elements, as DeepSpeed's
    partitioned parameters do, with ds_shape and ds_numel telling its real shape: reading it gives
    an empty result instead of a read of address 0 (norm() segfaulted). After close() it stays
    empty, keeps ds_shape, and initialize on that model is refused; destroy() gives the values
    back in their shapes."""
    from strata.param_state import ZeroParamStatus  # deepspeed's, re-exported there

    cfg = harness.config_for(STAGE3_RELEASE, tmp_path)
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    engine = _engine("gpt2", cfg, model=model)
    w = model.blocks[1].fc.weight
    assert {name: tuple(p.ds_shape) for name, p in model.named_parameters()} == shapes
    assert w.ds_numel == math.prod(shapes["blocks.1.fc.weight"])
    _run(engine, "gpt2", 0, 2)
    assert w.ds_status == ZeroParamStatus.NOT_AVAILABLE
    assert w.shape == (0,) and w.numel() == 0
    assert w.norm().item() == 0.0 and w.sum().item() == 0.0 and w.clone().numel() == 0
    assert engine.module.state_dict()["blocks.1.fc.weight"].numel() == 0
    masters = dict(zip([n for n, p in model.named_parameters() if p.requires_grad],
                       engine.master_parameters()))
    with strata.zero.GatheredParameters([w]):
        assert tuple(w.shape) == shapes["blocks.1.fc.weight"]
        assert torch.equal(w.detach(), masters["blocks.1.fc.weight"].view_as(w))
    assert w.numel() == 0
    # The engine's own reads never depended on the parameters' shapes.
    sd = engine.module_state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items() if k in shapes} == shapes
    engine.close()
    assert w.numel() == 0 and tuple(w.ds_shape) == shapes["blocks.1.fc.weight"]
    assert w.norm().item() == 0.0
    with pytest.raises(ValueError, match="has no memory"):
        strata.initialize(model=model, config=copy.deepcopy(cfg))
    # A forward through the closed engine names the cause (PyTorch's own error would be "'weight'
    # must be 2-D").
    x, y = harness.batch("gpt2", 0)
    with pytest.raises(strata.InvalidArgumentError, match="call engine.destroy"):
        engine(x, targets=y)
    with pytest.raises(strata.InvalidArgumentError, match="has no values to gather"):
        with strata.zero.GatheredParameters(list(model.parameters())):
            pass

    again = _engine("gpt2", cfg)
    _run(again, "gpt2", 0, 1)
    trained = again.master_parameters()
    again.destroy()
    params = [p for p in again.module.parameters() if p.requires_grad]
    assert [tuple(p.shape) for p in again.module.parameters()] == list(shapes.values())
    assert all(torch.equal(p.detach(), t.view_as(p)) for p, t in zip(params, trained))
    assert not any(hasattr(p, "ds_shape") for p in params)
    # After destroy() the model is plain PyTorch's again, and a forward through the engine runs
    # it (as DeepSpeed's does).
    torch.manual_seed(0)
    plain = harness.MODELS["gpt2"]()
    plain.load_state_dict(again.module.state_dict())
    with torch.no_grad():
        assert torch.equal(again(x, targets=y), plain(x, targets=y))


_KEPT_GRAPH = """
import copy, gc, sys
import torch, harness, strata
stage, end = int(sys.argv[1]), sys.argv[2]
cfg = harness.config_for(("kept", stage, "none", "none", 1, 0.0, True), sys.argv[3])
torch.manual_seed(0)
model = harness.MODELS["gpt2"]()
engine, _, _, _ = strata.initialize(model=model, config=copy.deepcopy(cfg))
x, y = harness.batch("gpt2", 0)
loss = engine(x, targets=y)
getattr(engine, end)()
del engine
gc.collect()
try:
    loss.backward()
    print("backward ran")
except RuntimeError as e:
    print("refused:", e)
del loss
gc.collect()
print("graph freed")
"""


@pytest.mark.parametrize("stage,end", [(1, "close"), (2, "destroy"), (3, "close"), (3, "destroy")])
def test_a_graph_kept_past_the_engine_is_freed_or_refused_safely(stage, end, tmp_path):
    """A loss whose graph outlives its engine (and, in Python, the engine's device): freeing it
    frees chunk memory on that device, which its views keep alive until then (it was freed
    through a dead device: a segfault), and a plain backward of it either runs on the views
    (stages 0-2, whose graph holds the values) or, under stage 3, whose units' hooks reached
    into the ended engine (a segfault, or a read of freed memory), is refused naming the cause.
    In a child process, so that a crash fails this test alone."""
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", _KEPT_GRAPH, str(stage), end, str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "graph freed" in run.stdout
    if stage == 3:
        assert "refused: FAILED_PRECONDITION: backward of a forward run by an engine that has " \
               "since ended" in run.stdout, run.stdout
    else:
        assert "backward ran" in run.stdout, run.stdout


def test_gathered_parameters_nest_and_name_what_is_wrong(tmp_path):
    """Nested GatheredParameters over the same parameter (DeepSpeed allows it) keep it gathered
    until the outermost block ends, and an evaluation forward may run inside one; a tensor of another shape assigned inside a writable block,
    and a gather after offload_states(), are refused naming the cause."""
    # Parameters on the device (offload_states moves their shards) and released after each unit.
    cfg = harness.config_for(("stage3_device_release", 3, "none", "none", 1, 0.0, False),
                             tmp_path)
    engine = _engine("gpt2", cfg)
    _run(engine, "gpt2", 0, 1)
    w = engine.module.blocks[1].fc.weight
    with strata.zero.GatheredParameters([w]):
        with strata.zero.GatheredParameters([w, engine.module.blocks[0].fc.weight]):
            assert tuple(w.shape) == tuple(w.ds_shape)
        assert tuple(w.shape) == tuple(w.ds_shape)  # the outer block still holds it
        value = w.detach().clone()
    assert w.numel() == 0
    # An evaluation forward inside a block over every parameter: the blocks hold the units.
    x, y = harness.batch("gpt2", 7)
    with torch.no_grad():
        before = harness.loss_of("gpt2", engine, x, y).item()
        with strata.zero.GatheredParameters(list(engine.module.parameters())):
            assert harness.loss_of("gpt2", engine, x, y).item() == before
    assert w.numel() == 0
    with pytest.raises(ValueError, match=r"had their tensor replaced inside the block"):
        with strata.zero.GatheredParameters([w], modifier_rank=0):
            w.data = torch.zeros(3)
    with strata.zero.GatheredParameters([w]):
        assert torch.equal(w.detach(), value)  # nothing was written
    engine.offload_states()
    with pytest.raises(RuntimeError, match=r"offload.*reload_states\(\)"):
        with strata.zero.GatheredParameters([w]):
            pass
    engine.reload_states()
    with strata.zero.GatheredParameters([w]):
        assert torch.equal(w.detach(), value)
    # What is not a parameter is named (it was an AttributeError from inside the gather).
    with pytest.raises(ValueError, match="pass a parameter or an iterable of parameters"):
        strata.zero.GatheredParameters("abc")
    with pytest.raises(ValueError, match=r"a int \(3\) among the parameters"):
        strata.zero.GatheredParameters([w, 3])
    assert all(math.isfinite(v) for v in _run(engine, "gpt2", 1, 1))
    engine.close()


def test_loss_backward_then_step_and_a_missing_config_are_refused(tmp_path):
    """loss.backward() bypasses the engine: at stage 0-2 step() used to do nothing silently, now
    it names engine.backward (stage 3's backward itself refuses it). initialize without any
    config is refused, as DeepSpeed refuses it; config={} runs on the defaults."""
    cfg = harness.config_for(STAGE2_CPU, tmp_path)
    cfg["zero_optimization"] = {"stage": 0}
    engine = _engine("gpt2", cfg)
    x, y = harness.batch("gpt2", 0)
    engine(x, targets=y).backward()
    with pytest.raises(ValueError, match=r"loss.backward\(\).*engine.backward\(loss\)"):
        engine.step()
    engine.close()
    engine = _engine("gpt2", harness.config_for(STAGE3_RELEASE, tmp_path))
    with pytest.raises(RuntimeError, match=r"engine.backward\(loss\)"):
        engine(x, targets=y).backward()
    engine.close()
    with pytest.raises(ValueError, match="no config"):
        strata.initialize(model=harness.kwargs_net())
    engine, *_ = strata.initialize(model=harness.kwargs_net(), config={})
    engine.close()


def test_a_non_finite_gradient_reports_a_nan_norm(tmp_path):
    """fp32 without clipping applies each update as its gradient arrives: a NaN gradient is
    applied (as a plain torch optimizer would) and the reported norm is NaN, not 0."""
    cfg = harness.config_for(STAGE2_CPU, tmp_path)
    cfg.pop("gradient_clipping", None)
    cfg.pop("fp16", None)
    cfg.pop("bf16", None)
    engine = _engine("gpt2", cfg)
    x, y = harness.batch("gpt2", 0)
    engine.backward(engine(x, targets=y) * float("nan"))
    engine.step()
    assert math.isnan(engine.get_global_grad_norm())
    engine.close()


@pytest.mark.parametrize("case, cpu_checkpointing", [(STAGE3_RELEASE, False), (STAGE3_NVME, True)],
                         ids=["stage3", "stage3_nvme_cpu_checkpointing"])
def test_activation_checkpointing_matches_plain_training(case, cpu_checkpointing, tmp_path):
    from gpt2_model import GPT2

    def build(checkpoint_fn=None):
        torch.manual_seed(0)
        return GPT2(vocab_size=256, seq_len=16, d_model=32, n_layers=3, n_heads=4, dropout=0.1,
                    checkpoint_fn=checkpoint_fn)

    cfg = harness.config_for(case, tmp_path,
                             activation_checkpointing={"cpu_checkpointing": cpu_checkpointing})
    accum = cfg["gradient_accumulation_steps"]
    plain = _engine("gpt2", cfg, model=build())
    want = _run(plain, "gpt2", 0, 4, accum)
    plain.close()
    ckpt = _engine("gpt2", cfg, model=build(strata.checkpointing.checkpoint))
    got = _run(ckpt, "gpt2", 0, 4, accum)
    stashed = ckpt.last_report["bytes_activations_stashed"]
    ckpt.close()
    # Dropout draws the same masks in the recomputation, so the runs agree exactly.
    assert got == want
    assert (stashed > 0) == cpu_checkpointing


def test_forward_error_releases_units_and_training_goes_on(tmp_path):
    engine = _engine("gpt2", harness.config_for(STAGE3_RELEASE, tmp_path))
    x, y = harness.batch("gpt2", 0)
    with pytest.raises(RuntimeError):
        engine(x[:, :1].repeat(1, 40), targets=y)  # longer than seq_len: fails inside 'embed'
    _run(engine, "gpt2", 0, 2)
    assert engine.global_steps == 2
    engine.close()


def test_plain_loss_backward_is_refused_with_the_fix(tmp_path):
    engine = _engine("gpt2", harness.config_for(STAGE3_RELEASE, tmp_path))
    x, y = harness.batch("gpt2", 0)
    loss = engine(x, targets=y)
    with pytest.raises(RuntimeError, match="engine"):
        loss.backward()
    engine.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_second_backward_before_step_is_refused_and_training_goes_on(stage, tmp_path):
    """With gradient_accumulation_steps=1 a backward after the step's last micro-step, before
    step(), would start the next step's updates over pending ones: the engine aborted the
    process. It is refused naming the fix, and the engine then steps and trains as usual."""
    cfg = harness.config_for(STAGE3_RELEASE if stage == 3 else STAGE2_CPU, tmp_path)
    if stage == 0:
        cfg["zero_optimization"] = {"stage": 0}
    engine = _engine("gpt2", cfg)
    x, y = harness.batch("gpt2", 0)
    engine.backward(engine(x, targets=y))
    with pytest.raises(RuntimeError, match=r"without Step: call step\(\) first"):
        engine.backward(engine(x, targets=y))
    engine.step()
    losses = _run(engine, "gpt2", 1, 2)
    assert engine.global_steps == 3
    assert all(math.isfinite(v) for v in losses)
    engine.close()


@pytest.mark.parametrize("stage", [0, 2])
def test_a_second_backward_in_one_micro_batch_is_refused_under_accumulation(stage, tmp_path):
    """With gradient_accumulation_steps=2, backward(l1); backward(l2); step() counted each
    backward as a micro-batch: the optimizer stepped on every step() call, each time on half a
    batch (DeepSpeed adds both into one micro-batch). It is refused naming both ways out, and
    the engine then trains on as plain PyTorch does."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    engine, *_ = strata.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)) for _ in range(4)]
    x1, x2 = batches[0]
    engine.backward(engine(x1).pow(2).mean())
    with pytest.raises(ValueError, match="second backward in one micro-batch.*add the losses"):
        engine.backward(engine(x2).abs().mean())
    engine.step()
    assert engine.global_steps == 0
    # Micro-batch 0 holds the first loss only; micro-batches 1-3 take one backward of the
    # summed losses each.
    for x1, x2 in batches[1:]:
        engine.backward(engine(x1).pow(2).mean() + engine(x2).abs().mean())
        engine.step()
    assert engine.global_steps == 2
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.0)
    for i, (x1, x2) in enumerate(batches):
        loss = ref(x1).pow(2).mean() + (ref(x2).abs().mean() if i else 0)
        (loss / 2).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
    for p, q in zip(engine.master_parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q.detach(), rtol=1e-5, atol=1e-6)
    engine.close()


def test_model_parameters_may_hold_frozen_ones_as_deepspeed_takes_them(tmp_path):
    """model.parameters() with some frozen is DeepSpeed's usual call: the frozen ones are left
    out (a group of nothing but frozen ones too), and only the trainable ones change. Bad
    model_parameters and a meta-device model are refused naming what is wrong."""
    cfg = harness.config_for(STAGE2_CPU, tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    model[0].requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 1e-2}]
    for given in (model.parameters(), groups):
        m = copy.deepcopy(model)
        if isinstance(given, list):
            given = [{"params": m[0].parameters()}, {"params": m[1].parameters(), "lr": 1e-2}]
        else:
            given = m.parameters()
        before = m[1].weight.detach().clone()
        engine, *_ = strata.initialize(model=m, model_parameters=given, config=copy.deepcopy(cfg))
        for _ in range(2):
            engine.backward(engine(torch.randn(2, 8)).square().sum())
            engine.step()
        engine.destroy()
        assert torch.equal(m[0].weight, frozen)
        assert not torch.equal(m[1].weight, before)
    bads = ((lambda m: 5, "model_parameters=int"),
            (lambda m: [{"lr": 1.0}], "a group without 'params'"),
            (lambda m: [{"params": m[1].parameters(), "betas": (0.9,)}], r"betas=\(0.9,\): must be two"),
            (lambda m: [{"params": m[1].parameters(), "lr": "x"}], "lr='x': must be a number"),
            (lambda m: "abc", "model_parameters=str"),
            (lambda m: [m[1].weight, 3], r"holds a int \(3\), not a parameter"),
            (lambda m: [{"params": [m[1].weight]}, {"params": [m[1].weight, m[1].bias]}],
             "is in parameter groups 0 and 1"),
            (lambda m: list(m[1].parameters()) + [torch.nn.Parameter(torch.zeros(3))],
             r"shape \(3,\) that is not a trainable parameter"),
            (lambda m: [m[1].weight], r"1 of 2 are missing \('1.bias'\)"))
    for bad, want in bads:
        m = copy.deepcopy(model)
        with pytest.raises(ValueError, match=want):
            strata.initialize(model=m, model_parameters=bad(m), config=copy.deepcopy(cfg))
    meta = torch.nn.Linear(8, 8, device="meta") if hasattr(torch.nn.Linear(1, 1), "to_empty") else None
    if meta is not None:
        with pytest.raises(ValueError, match="meta device"):
            strata.initialize(model=meta, config=copy.deepcopy(cfg))


def test_the_training_loader_is_deepspeeds(tmp_path, monkeypatch):
    # Under a launcher (LOCAL_RANK set) DeepSpeed's loader deals the data out through a
    # DistributedSampler (a shuffle seeded with 0) and keeps the last partial batch unless the
    # config sets dataloader_drop_last.
    monkeypatch.setenv("LOCAL_RANK", "0")
    data = torch.utils.data.TensorDataset(torch.arange(10.0))
    want = [float(i) for i in torch.utils.data.distributed.DistributedSampler(
        data, num_replicas=1, rank=0)]
    assert want != sorted(want)
    for drop, sizes in ((False, [4, 4, 2]), (True, [4, 4])):
        cfg = harness.config_for(STAGE2_CPU, tmp_path, micro=4)
        if drop:
            cfg["dataloader_drop_last"] = True
        engine, _, loader, _ = strata.initialize(model=harness.kwargs_net(), config=cfg,
                                                 training_data=data)
        got = [x for (x,) in loader]
        assert [len(x) for x in got] == sizes
        assert torch.cat(got).tolist() == want[:sum(sizes)]
        engine.close()


def test_training_data_loader_and_boundaries(tmp_path):
    cfg = harness.config_for(STAGE2_CPU, tmp_path)
    cfg["gradient_accumulation_steps"] = 2
    data = torch.utils.data.TensorDataset(torch.randn(10, 24), torch.randint(0, 5, (10,)))
    torch.manual_seed(0)
    engine, _, loader, schedule = strata.initialize(model=harness.kwargs_net(), config=cfg,
                                                    training_data=data)
    assert schedule is None
    sizes, boundaries = [], []
    for x, y in loader:
        sizes.append(len(x))
        engine.backward(engine(x, y)["loss"])
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.step()
    assert sizes == [2] * 5
    assert boundaries == [False, True, False, True, False]
    assert engine.global_steps == 2
    assert json.dumps(engine.describe())  # placement report is JSON
    assert engine.device == torch.device(engine.describe()["torch_device"])
    # The display name starts with it ("cpu", or "cuda:0 (NVIDIA ...)").
    assert engine.describe()["device"].startswith(str(engine.device))
    engine.close()


def test_eval_after_training_matches_pytorch(tmp_path):
    # resnet18: eval() switches BatchNorm to its running statistics, which the engine must have
    # kept up to date in the model's own buffers.
    _, reference = harness.train_reference("resnet18", 2)
    engine = _engine("resnet18", harness.config_for(STAGE3_RELEASE, tmp_path))
    _run(engine, "resnet18", 0, 2)
    x, _ = harness.batch("resnet18", 99)
    reference.eval()
    engine.eval()
    assert not engine.module.training
    with torch.no_grad():
        want = reference(x)
        got = engine(x)
    assert engine.global_steps == 2  # evaluation opened no micro-step
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    engine.train()
    assert engine.module.training
    engine.close()


def test_compute_lane_covers_the_python_forward(tmp_path):
    # The step report's compute lane must include the forward the Python hooks drive, not only
    # backward: with everything on the device and nothing to wait for, compute is nearly the
    # whole step (before the engine timed the forward span it read about 0.6 of it).
    from gpt2_model import GPT2

    torch.manual_seed(0)
    model = GPT2(vocab_size=256, seq_len=64, d_model=128, n_layers=4, n_heads=4)
    engine, *_ = strata.initialize(model=model, config={"train_micro_batch_size_per_gpu": 8,
                                                        "zero_optimization": {"stage": 0}})
    ratios = []
    for _ in range(4):
        t = torch.randint(0, 256, (8, 65))
        engine.backward(engine(t[:, :-1], targets=t[:, 1:]))
        engine.step()
        ratios.append(engine.last_report["compute_s"] / engine.last_report["step_time_s"])
    engine.close()
    assert max(ratios[1:]) > 0.8, ratios


def test_step_report_is_a_bound_class_that_reads_as_a_mapping(tmp_path):
    # engine.last_report is _strata.StepReport: attributes, and the mapping it was (the keys are
    # the C++ report's ToJson keys, the names strata-train --json writes).
    engine = _engine("gpt2", harness.config_for(STAGE3_RELEASE, tmp_path))
    t = torch.randint(0, 256, (2, 17))
    engine.backward(engine(t[:, :-1], targets=t[:, 1:]))
    engine.step()
    report = engine.last_report
    engine.close()
    assert type(report).__name__ == "StepReport"
    assert report.step == 1 and not report.skipped
    assert report.lr == engine.get_lr()[0]
    assert report.step_time_s > 0 and report.compute_s > 0
    keys = report.keys()
    assert {"step", "lr", "grad_norm", "overlap", "bytes_host_to_nvme"} <= set(keys)
    as_dict = report.to_dict()
    assert list(as_dict) == keys
    for k in keys:
        assert report[k] == as_dict[k] == getattr(report, k) or report[k] != report[k]  # NaN
        assert k in report
    assert "no_such_figure" not in report
    assert report.get("no_such_figure", 7) == 7
    with pytest.raises(KeyError):
        report["no_such_figure"]
    with pytest.raises(AttributeError):
        report.step = 5  # read-only


def test_default_units_are_the_engines_rule():
    # strata.units.default_units asks the C++ rule (runtime/engine/unit_rule.h) through the
    # bindings: containers and their subclasses are looked through, frozen children and the
    # root's own parameters are not units, and a module reached twice is one unit.
    class Blocks(torch.nn.ModuleList):
        pass

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(1))
            self.embed = torch.nn.Embedding(4, 2)
            self.frozen = torch.nn.Linear(2, 2).requires_grad_(False)
            shared = torch.nn.Linear(2, 2)
            self.blocks = Blocks([torch.nn.Linear(2, 2), shared])
            self.heads = torch.nn.ModuleDict({"a": torch.nn.Sequential(torch.nn.ReLU(),
                                                                       torch.nn.Linear(2, 2))})
            self.tied = shared

    net = Net()
    units = strata.units.default_units(net)
    assert [n for n, _ in units] == ["embed", "blocks.0", "blocks.1", "heads.a.1"]
    assert units[2][1] is net.tied
    assert all(m is net.get_submodule(n) for n, m in units)


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_casts_frozen_parameters_and_buffers_as_deepspeed(stage, tmp_path):
    # DeepSpeed's engine turns the whole module to bf16 (module.bfloat16()): a frozen layer and a
    # BatchNorm's running statistics then meet bf16 activations in their own type. Strata casts
    # what no unit manages the same way; before, both failed in forward with a dtype mismatch.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    model[3].requires_grad_(False)  # frozen
    frozen = model[3].weight.detach().clone()
    engine, *_ = strata.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    assert model[1].running_mean.dtype == torch.bfloat16
    assert model[3].weight.dtype == torch.bfloat16 and not model[3].weight.requires_grad
    assert model[1].num_batches_tracked.dtype == torch.int64  # integers keep their type
    losses = []
    for step in range(4):
        x = torch.randn(4, 8, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(step))
        y = torch.randint(0, 4, (4,), generator=torch.Generator().manual_seed(100 + step))
        loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses), losses
    assert torch.equal(model[3].weight.float(), frozen.to(torch.bfloat16).float())  # not trained
    assert int(model[1].num_batches_tracked) == 4
    engine.close()


def test_a_setup_error_after_the_engine_started_gives_the_model_back(tmp_path):
    """initialize starts the engine before it checks the scheduler and the training data: under
    stage 3 the engine then holds the weights. A setup that fails there (a scheduler callable
    that returns no scheduler) gives them back: the model holds its own values again, and
    initialize on it then trains exactly as on a fresh model."""
    cfg = harness.config_for(STAGE3_RELEASE, tmp_path)
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(strata.InvalidArgumentError, match="not a scheduler"):
        strata.initialize(model=model, config=copy.deepcopy(cfg), lr_scheduler=lambda opt: 5)
    after = list(model.parameters())
    assert [p.shape for p in after] == [p.shape for p in before]
    assert all(torch.equal(p.detach(), v) for p, v in zip(after, before))
    again = _engine("gpt2", cfg, model=model)
    fresh = _engine("gpt2", cfg)
    assert _run(again, "gpt2", 0, 2) == _run(fresh, "gpt2", 0, 2)
    again.close()
    fresh.close()
