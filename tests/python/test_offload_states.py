"""engine.offload_states / reload_states (DeepSpeed's API, ZeRO stage 3): the chosen states leave
the device (its allocator's counter falls by their size), the engine refuses to train until they
are back, and after reload_states training goes on bit for bit as if nothing had moved."""

import copy
import os
import sys

import pytest
import torch

import harness
import strata
from strata import InvalidArgumentError

COMPAT = os.environ.get("STRATA_DS_COMPAT")
if not COMPAT:
    pytest.skip("STRATA_DS_COMPAT (the build's deepspeed-compat folder) is not set",
                allow_module_level=True)
sys.path.insert(0, COMPAT)
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.runtime.zero.offload_config import (  # noqa: E402
    OffloadDeviceEnum, OffloadStateTypeEnum)

CASES = {c[0]: c for c in harness.GRID}


def _engine(name, tmp_path):
    case = CASES[name]
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    cfg = harness.config_for(case, tmp_path / "nvme")
    engine, *_ = strata.initialize(model=model, config=copy.deepcopy(cfg))
    return engine, case[4]


def test_offloaded_states_free_the_device_and_come_back_bit_for_bit(tmp_path):
    straight, accum = _engine("stage3", tmp_path)
    want = harness.run_steps(straight, "gpt2", 0, 4, accum)
    want_params = straight.master_parameters()
    straight.close()

    engine, accum = _engine("stage3", tmp_path)
    got = harness.run_steps(engine, "gpt2", 0, 2, accum)
    acc = get_accelerator()
    before = acc.memory_allocated()
    assert before == engine._cpp.device_bytes_in_use > 0
    n = engine._cpp.num_parameters
    # fp32 stage 3 on the device: param16 (fp32 here, and the master too: Note [shared master]),
    # both moments and the grad shard.
    engine.offload_states(device=OffloadDeviceEnum.cpu)
    after = acc.memory_allocated()
    assert before - after >= 4 * 4 * n
    with pytest.raises(InvalidArgumentError, match="reload_states"):
        harness.run_steps(engine, "gpt2", 2, 1, accum)
    engine.reload_states()
    assert acc.memory_allocated() >= after + 4 * 4 * n
    got += harness.run_steps(engine, "gpt2", 2, 2, accum)
    assert got == want  # bit for bit
    for a, b in zip(engine.master_parameters(), want_params):
        assert torch.equal(a, b)
    engine.close()


def test_only_the_named_states_move(tmp_path):
    engine, accum = _engine("stage3", tmp_path)
    harness.run_steps(engine, "gpt2", 0, 1, accum)
    acc = get_accelerator()
    n = engine._cpp.num_parameters
    before = acc.memory_allocated()
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states])
    moved = before - acc.memory_allocated()
    assert 2 * 4 * n <= moved < 3 * 4 * n  # exp_avg and exp_avg_sq (chunk padding aside)
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states])  # again: nothing more
    assert before - acc.memory_allocated() == moved
    engine.reload_states()
    assert acc.memory_allocated() == before
    harness.run_steps(engine, "gpt2", 1, 1, accum)
    engine.close()


def test_states_already_off_the_device_stay_where_they_are(tmp_path):
    engine, accum = _engine("stage3_cpu_release", tmp_path)
    harness.run_steps(engine, "gpt2", 0, 1, accum)
    before = get_accelerator().memory_allocated()
    engine.offload_states()
    assert get_accelerator().memory_allocated() == before
    engine.reload_states()
    harness.run_steps(engine, "gpt2", 1, 1, accum)
    engine.close()


def test_what_deepspeed_refuses_is_refused_by_name(tmp_path):
    engine, accum = _engine("stage2", tmp_path)
    with pytest.raises(strata.StrataError, match="stage 3"):
        engine.offload_states()
    engine.close()
    engine, accum = _engine("stage3", tmp_path)
    with pytest.raises(InvalidArgumentError, match="only 'cpu'"):
        engine.offload_states(device=OffloadDeviceEnum.nvme)
    with pytest.raises(InvalidArgumentError, match="unknown state type"):
        engine.offload_states(include=["optimizer"])
    engine.close()


def test_a_master_that_is_the_working_shard_moves_with_lp_params(tmp_path):
    # fp32 stage 3 on the device: the master is the param16 block (Note [shared master]), so
    # offloading lp_params takes it along. Reading it or saving a checkpoint is refused, naming
    # reload_states, until the states are back; then both work and training goes on.
    engine, accum = _engine("stage3", tmp_path)
    harness.run_steps(engine, "gpt2", 0, 1, accum)
    want = [p.clone() for p in engine.master_parameters()]
    engine.offload_states(include=[OffloadStateTypeEnum.lp_params])
    with pytest.raises(strata.StrataError, match="reload_states"):
        engine.master_parameters()
    with pytest.raises(strata.StrataError, match="reload_states"):
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.reload_states()
    got = engine.master_parameters()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    harness.run_steps(engine, "gpt2", 1, 1, accum)
    engine.close()
