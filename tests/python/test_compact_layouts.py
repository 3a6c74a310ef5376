"""The compact layouts through the engine (Note [compact layouts] in runtime/state/step_plan.h):
bf16.bf16_master_weights_and_grads (a bf16 master, stochastic or nearest rounding) and
strata.optimizer_state_dtype int8 (8-bit blockwise moments), with the cpu and nvme offload of the
optimizer and the device's own optimizer (the CPU device's here; a GPU's CUDA kernels where the
suite runs on one). Each is deterministic, resumes bit-exact from a checkpoint, trains close to
the fp32 layout, gives the same bits on the device's optimizer as on the host's, and a bf16
stochastic master is independent of the chunk size (its rounding bits follow the model's element
index)."""

import copy

import pytest
import torch

import harness
import strata

STEPS = 6


def _cfg(tmp_path, stage=2, optim="cpu", param="none", master=False, sr=True, moments="fp32",
         chunk="16KiB"):
    z = {"stage": stage, "offload_optimizer": {"device": optim},
         "offload_param": {"device": param}}
    if "nvme" in (optim, param):
        (tmp_path / "nvme").mkdir(parents=True, exist_ok=True)
        z["offload_optimizer"]["nvme_path"] = str(tmp_path / "nvme")
        z["offload_param"]["nvme_path"] = str(tmp_path / "nvme")
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": z,
            "bf16": {"enabled": True, "bf16_master_weights_and_grads": master},
            "strata": {"chunk_size": chunk, "optimizer_state_dtype": moments,
                       "stochastic_rounding": sr},
            "optimizer": {"type": "AdamW",
                          "params": {"lr": 3e-3, "weight_decay": harness.WEIGHT_DECAY}}}


def _train(cfg, steps=STEPS, save=None, resume=None, first=0):
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    engine, *_ = strata.initialize(model=model, model_parameters=model.parameters(),
                                   config=copy.deepcopy(cfg))
    if resume is not None:
        engine.load_checkpoint(resume)
    losses = harness.run_steps(engine, "gpt2", first, steps)
    if save is not None:
        engine.save_checkpoint(save)
    masters = [p.detach().clone() for p in engine.master_parameters()]
    engine.close()
    return losses, masters


LAYOUTS = [
    ("bf16_sr_master", dict(master=True)),
    ("bf16_nearest_master", dict(master=True, sr=False)),
    ("int8_moments", dict(moments="int8")),
    ("bf16_sr_master_int8", dict(master=True, moments="int8")),
]
PLACEMENTS = [
    ("stage2_cpu", dict(stage=2, optim="cpu")),
    ("stage3_nvme", dict(stage=3, optim="nvme", param="nvme")),
    ("stage1_device", dict(stage=1, optim="none")),
]


@pytest.mark.parametrize("placement", PLACEMENTS, ids=[p[0] for p in PLACEMENTS])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[l[0] for l in LAYOUTS])
def test_layout_is_deterministic_and_trains_like_fp32(layout, placement, tmp_path):
    cfg = _cfg(tmp_path, **placement[1], **layout[1])
    a, ma = _train(cfg)
    b, mb = _train(cfg)
    assert a == b and all(torch.equal(x, y) for x, y in zip(ma, mb))  # bit-identical runs
    fp32, mf = _train(_cfg(tmp_path, **placement[1]))
    assert not all(torch.equal(x, y) for x, y in zip(ma, mf))  # the layout changed the run
    # Six steps of AdamW at lr 3e-3 on the byte-level GPT: the compact layouts stay within 2 %
    # of the fp32 layout's loss, step by step.
    for got, want in zip(a, fp32):
        assert abs(got - want) <= 0.02 * abs(want), (a, fp32)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[l[0] for l in LAYOUTS])
def test_layout_resumes_bit_exact(layout, tmp_path):
    cfg = _cfg(tmp_path, stage=3, optim="cpu", param="cpu", **layout[1])
    whole, mw = _train(cfg, steps=STEPS)
    first, _ = _train(cfg, steps=3, save=tmp_path / "ckpt")
    second, ms = _train(cfg, steps=STEPS - 3, resume=tmp_path / "ckpt", first=3)
    assert first + second == whole
    assert all(torch.equal(x, y) for x, y in zip(ms, mw))


def test_device_homed_shared_master_resumes_bit_exact(tmp_path):
    # Stage 3 with everything on the device: the bf16 master is the device's working shard
    # (Note [shared master]), saved and loaded through host copies.
    cfg = _cfg(tmp_path, stage=3, optim="none", param="none", master=True, moments="int8")
    whole, mw = _train(cfg, steps=STEPS)
    first, _ = _train(cfg, steps=3, save=tmp_path / "ckpt")
    second, ms = _train(cfg, steps=STEPS - 3, resume=tmp_path / "ckpt", first=3)
    assert first + second == whole
    assert all(torch.equal(x, y) for x, y in zip(ms, mw))


def test_stochastic_master_does_not_depend_on_the_chunk_size(tmp_path):
    small = _cfg(tmp_path, master=True, chunk="16KiB")
    large = _cfg(tmp_path, master=True, chunk="1MiB")
    a, ma = _train(small)
    b, mb = _train(large)
    assert a == b and all(torch.equal(x, y) for x, y in zip(ma, mb))


OPTIMIZERS = [
    ("sgd_momentum", {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}}),
    ("adagrad", {"type": "Adagrad", "params": {"lr": 0.05}}),
    ("lion", {"type": "Lion", "params": {"lr": 3e-4, "weight_decay": 0.1}}),
]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
@pytest.mark.parametrize("layout", LAYOUTS + [("bf16_moments", dict(moments="bf16"))],
                         ids=[l[0] for l in LAYOUTS] + ["bf16_moments"])
def test_other_optimizers_run_every_layout(optimizer, layout, tmp_path):
    # SGD's momentum, Adagrad's sum and Lion's momentum in each layout, on the host optimizer:
    # deterministic, and within 2 % of the same optimizer with fp32 states.
    cfg = _cfg(tmp_path, **layout[1])
    cfg["optimizer"] = optimizer[1]
    a, ma = _train(cfg)
    b, mb = _train(cfg)
    assert a == b and all(torch.equal(x, y) for x, y in zip(ma, mb))
    plain = _cfg(tmp_path)
    plain["optimizer"] = optimizer[1]
    want, _ = _train(plain)
    for got, ref in zip(a, want):
        assert abs(got - ref) <= 0.02 * abs(ref), (a, want)


def test_a_checkpoint_of_another_layout_converts_and_says_so(tmp_path, capfd):
    # fp32 states saved, loaded into a bf16-master, 8-bit-moment run: the master arrives rounded
    # to nearest bf16 (the moments quantized), training goes on; and the way back.
    plain = _cfg(tmp_path, stage=3, optim="cpu", param="cpu")
    compact = _cfg(tmp_path, stage=3, optim="cpu", param="cpu", master=True, moments="int8")
    _, saved = _train(plain, steps=3, save=tmp_path / "fp32")
    capfd.readouterr()
    _, loaded = _train(compact, steps=0, resume=tmp_path / "fp32")
    assert "converting its master and moments to this run's int8+bf16_master" in capfd.readouterr().err
    assert all(torch.equal(x, y.to(torch.bfloat16).float()) for x, y in zip(loaded, saved))
    more, _ = _train(compact, steps=2, resume=tmp_path / "fp32", first=3)
    want, _ = _train(plain, steps=2, resume=tmp_path / "fp32", first=3)
    for got, ref in zip(more, want):
        assert abs(got - ref) <= 0.02 * abs(ref), (more, want)
    # Back: a compact checkpoint into fp32 states (bf16 values are exact in fp32).
    _, compact_saved = _train(compact, steps=2, save=tmp_path / "compact")
    _, back = _train(plain, steps=0, resume=tmp_path / "compact")
    assert all(torch.equal(x, y) for x, y in zip(back, compact_saved))


def test_bad_combinations_are_refused_naming_the_keys(tmp_path):
    cfg = _cfg(tmp_path, master=True)
    cfg["bf16"]["enabled"] = False
    with pytest.raises(strata.InvalidArgumentError, match="needs bf16.enabled=true"):
        _train(cfg, steps=1)
    cfg = _cfg(tmp_path, moments="int8")
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    with pytest.raises(strata.InvalidArgumentError, match="SGD without momentum keeps no"):
        _train(cfg, steps=1)
    cfg = _cfg(tmp_path, moments="int8")
    cfg["bf16"]["bf16_optimizer_states"] = True
    with pytest.raises(strata.InvalidArgumentError, match="two moment formats"):
        _train(cfg, steps=1)


def test_per_parameter_access_reads_and_writes_8bit_moments(tmp_path):
    # safe_get/set_full_optimizer_state on 8-bit moments decode and encode the shard's blocks.
    # After one step both runs hold m = (1 - beta1) g of the same gradient, so the 8-bit one
    # reads within the format's bound of fp32's: 0.0070 of its block's scale. Every parameter
    # starts at a block boundary, so a block's scale is at most its own parameter's largest |m|.
    from strata import param_state

    def one_step(moments):
        torch.manual_seed(0)
        model = harness.MODELS["gpt2"]()
        cfg = _cfg(tmp_path, stage=3, optim="cpu", param="cpu", moments=moments)
        engine, *_ = strata.initialize(model=model, model_parameters=model.parameters(),
                                       config=copy.deepcopy(cfg))
        harness.run_steps(engine, "gpt2", 0, 1)
        return engine, model

    plain, plain_model = one_step("fp32")
    want = {n: param_state.safe_get_full_optimizer_state(p, "exp_avg").clone()
            for n, p in plain_model.named_parameters()}
    plain.close()
    engine, model = one_step("int8")
    for name, p in model.named_parameters():
        got = param_state.safe_get_full_optimizer_state(p, "exp_avg")
        bound = 0.0071 * want[name].abs().max().item()
        assert (got - want[name]).abs().max().item() <= bound, name
        assert not torch.equal(got, want[name]) or want[name].abs().max() == 0  # really 8-bit
    name, p = next(iter(model.named_parameters()))
    # The read comes back on the engine's device (a GPU where the suite runs on one).
    shape = getattr(p, "ds_shape", p.shape)  # a released stage-3 parameter has 0 elements
    value = torch.linspace(-1e-3, 1e-3, shape.numel(), device=engine.device).view(shape)
    param_state.safe_set_full_optimizer_state(p, value, "exp_avg")
    back = param_state.safe_get_full_optimizer_state(p, "exp_avg")
    assert back.device == value.device
    assert (back - value).abs().max().item() <= 0.0071 * 1e-3
    engine.close()


RANK_CASES = [
    ("bf16_sr_master_stage2_cpu", dict(stage=2, optim="cpu", master=True)),
    ("bf16_sr_master_bf16_moments_stage3_nvme", dict(stage=3, optim="nvme", param="nvme",
                                                     master=True, moments="bf16")),
    ("bf16_sr_master_int8_stage2_cpu", dict(stage=2, optim="cpu", master=True, moments="int8")),
    ("int8_moments_stage3_nvme", dict(stage=3, optim="nvme", param="nvme", moments="int8")),
    # The device's own optimizer, the bf16 master being the device-homed working shard.
    ("bf16_sr_master_int8_stage3_device", dict(stage=3, optim="none", param="none", master=True,
                                               moments="int8")),
]


def _full_state(cfg, steps):
    """One rank: the loss per step and each parameter's full master and moments, as the
    two-rank worker reads them."""
    from strata import param_state
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    engine, *_ = strata.initialize(model=model, model_parameters=model.parameters(),
                                   config=copy.deepcopy(cfg))
    result = {"loss": harness.run_steps(engine, "gpt2", 0, steps), "master": {}, "exp_avg": {},
              "exp_avg_sq": {}}
    for name, p in model.named_parameters():
        result["master"][name] = param_state.safe_get_full_fp32_param(p).flatten().tolist()
        for key in ("exp_avg", "exp_avg_sq"):
            result[key][name] = param_state.safe_get_full_optimizer_state(p, key).flatten().tolist()
    engine.close()
    return result


@pytest.mark.skipif(not harness.have_gloo(),
                    reason="this build has no c10d Gloo (its headers were missing at build time)")
@pytest.mark.parametrize("case", RANK_CASES, ids=[c[0] for c in RANK_CASES])
def test_compact_layouts_on_two_ranks_and_another_chunk_size(case, tmp_path):
    # Two ranks fed the same micro-batch reduce to exactly one rank's gradient ((g + g) / 2 = g),
    # and the two-rank run uses a chunk size 64 times smaller than the one-rank run. Each layout
    # must come out bit-identical: a bf16 stochastic master's rounding bits follow the model's
    # element index, not the shard or chunk an element lands in, and under 8-bit moments every
    # parameter starts at a block boundary (StepPlan::ChunkLayout), so each block holds the same
    # elements of one parameter in both runs.
    import json
    steps = 4
    one = _full_state(_cfg(tmp_path / "one", chunk="1MiB", **case[1]), steps)
    cfg = _cfg(tmp_path / "two", chunk="16KiB", **case[1])
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"config": cfg, "steps": steps}))
    ranks = harness.launch_two_ranks("compact_rank_worker.py", [spec], tmp_path)
    for rank, got in enumerate(ranks):
        assert got["loss"] == one["loss"], (rank, got["loss"], one["loss"])
        for key in ("master", "exp_avg", "exp_avg_sq"):
            for name, want in one[key].items():
                assert got[key][name] == want, f"rank {rank}: {key} of {name} differs"


RELAYOUT_CASES = [
    # (name, the saving run's settings, the loading run's), each on two ranks.
    ("fp32_stage2_16KiB_to_1MiB", dict(stage=2, optim="cpu", chunk="16KiB"),
     dict(stage=2, optim="cpu", chunk="1MiB")),
    ("int8_stage3_nvme_1MiB_to_16KiB", dict(stage=3, optim="nvme", param="nvme", moments="int8",
                                            chunk="1MiB"),
     dict(stage=3, optim="nvme", param="nvme", moments="int8", chunk="16KiB")),
    ("bf16_master_stage1_to_int8_other_chunks", dict(stage=1, optim="cpu", master=True,
                                                     chunk="16KiB"),
     dict(stage=1, optim="cpu", master=True, moments="bf16", chunk="64KiB")),
]


@pytest.mark.skipif(not harness.have_gloo(),
                    reason="this build has no c10d Gloo (its headers were missing at build time)")
@pytest.mark.parametrize("case", RELAYOUT_CASES, ids=[c[0] for c in RELAYOUT_CASES])
def test_a_checkpoint_loads_into_other_chunks(case, tmp_path):
    # Note [loading another chunk layout]: a run saved with other chunks (another chunk_size,
    # the 8-bit alignment) loads parameter by parameter, every rank reading the shards it needs
    # from every saving rank's file. The masters and moments arrive exact, and an exact layout
    # does not depend on the chunks, so the resumed run equals the uninterrupted one bit for bit
    # (8-bit blocks are copied as they are). The last case also changes the moments' format
    # (fp32 saved, bf16 loaded), so it is compared by loss.
    import json
    name, saving, loading = case
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"from": _cfg(tmp_path / "from", **saving),
                                "into": _cfg(tmp_path / "into", **loading),
                                "ckpt": str(tmp_path / "ckpt")}))
    ranks = harness.launch_two_ranks("relayout_worker.py", [spec], tmp_path)
    for rank, got in enumerate(ranks):
        if saving.get("moments", "fp32") == loading.get("moments", "fp32"):
            assert got["resumed"] == got["whole"], (rank, got["resumed"], got["whole"])
            assert got["resumed_masters"] == got["whole_masters"], rank
        else:
            for a, b in zip(got["resumed"], got["whole"]):
                assert abs(a - b) <= 0.02 * abs(b), (rank, got["resumed"], got["whole"])


def test_a_damaged_checkpoint_is_refused_when_loading_into_other_chunks(tmp_path):
    # The parameter-by-parameter load reads through the same crc32c check: a flipped byte in a
    # saved block is refused, naming the file and the block.
    saving = _cfg(tmp_path, chunk="16KiB", moments="int8")
    _train(saving, steps=2, save=tmp_path / "ckpt")
    step_dir = next((tmp_path / "ckpt").glob("global_step*/step-*"))
    data = bytearray((step_dir / "rank-00000.bin").read_bytes())
    data[len(data) // 3] ^= 0x40
    (step_dir / "rank-00000.bin").write_bytes(bytes(data))
    with pytest.raises(strata.StrataError, match="fails its crc32c check"):
        _train(_cfg(tmp_path, chunk="1MiB", moments="int8"), steps=0, resume=tmp_path / "ckpt")


@pytest.mark.parametrize("layout", LAYOUTS, ids=[l[0] for l in LAYOUTS])
def test_device_optimizer_equals_host_optimizer_bit_for_bit(layout, tmp_path):
    # The device's own compact step (the CUDA kernels on a GPU, the CPU kernels on the CPU
    # device) and the host optimizer's give the same bits: same gradients in, same masters out.
    on_device, md = _train(_cfg(tmp_path, stage=1, optim="none", **layout[1]))
    on_host, mh = _train(_cfg(tmp_path, stage=1, optim="cpu", **layout[1]))
    assert on_device == on_host
    assert all(torch.equal(x, y) for x, y in zip(md, mh))


@pytest.mark.parametrize("placement", PLACEMENTS, ids=[p[0] for p in PLACEMENTS])
def test_a_nan_gradient_reaches_8bit_moments_without_a_crash(placement, tmp_path):
    # Without clipping or loss scaling nothing gates the updates, so they run during backward
    # and a NaN loss's gradients reach the optimizer. The 8-bit quantizer once read past its
    # bucket table on a NaN moment (a segfault on AVX2 and AVX-512); now the step completes and
    # the NaN shows in the master, as it does with fp32 states.
    cfg = _cfg(tmp_path, **placement[1], master=True, moments="int8")
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    engine, *_ = strata.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for step in range(3):
        x, y = harness.batch("gpt2", step, 0, 1, 2)
        loss = harness.loss_of("gpt2", engine, x, y)
        engine.backward(loss * float("nan") if step == 1 else loss)
        engine.step()
    masters = [p.detach().clone() for p in engine.master_parameters()]
    engine.close()
    assert any(torch.isnan(m).any() for m in masters)
