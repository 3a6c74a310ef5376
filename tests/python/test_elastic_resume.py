"""A checkpoint resumes on another number of ranks, another ZeRO stage and another precision
(Note [elastic resume] in runtime/engine/engine_checkpoint.cc): right after the load, every
parameter's master and moments are the saved ones bit for bit, read back through DeepSpeed's
collective accessors on each side; and the resumed run's losses follow those of the run that went
on, within the rounding of another reduction order. The global batch is the same on both sides
(micro-batch x ranks), so the data is the same."""

import json
import os
import re
import subprocess
import sys

import pytest

import harness

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, MORE = 3, 3


def _config(stage, offload, micro, tmp_path, precision="fp32", state_dtype=None, accum=1,
            chunk_size=None):
    cfg = harness.config_for(("elastic", stage, offload if stage == 3 else "none", offload, accum,
                              1.0, True), tmp_path / "nvme", micro=micro)
    if chunk_size:
        cfg["strata"]["chunk_size"] = chunk_size
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        # A small first scale: no step of this model overflows, so both runs apply every step.
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    if state_dtype:
        cfg["strata"]["optimizer_state_dtype"] = state_dtype
    return cfg


def _run(mode, world, cfg, tmp_path, **more_spec):
    spec = {"mode": mode, "config": cfg, "checkpoint": str(tmp_path / "ckpt"), "steps": STEPS,
            "more": MORE, **more_spec}
    spec_path = tmp_path / f"{mode}.json"
    spec_path.write_text(json.dumps(spec))
    out = str(tmp_path / mode)
    cmd = [sys.executable, os.path.join(HERE, "elastic_rank_worker.py"), str(spec_path), out]
    if world > 1:
        launcher = os.path.join(os.environ.get("STRATA_BIN", ""), "strata-launch")
        if not os.path.exists(launcher):
            pytest.fail(f"strata-launch not found at {launcher}: export STRATA_BIN=<build>/bin")
        cmd = [launcher, "--nproc", str(world), "--"] + cmd
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    ranks = []
    for r in range(world):
        with open(f"{out}.rank{r}.json", encoding="utf-8") as f:
            ranks.append(json.load(f))
    return ranks, run.stderr


def _mean_loss(ranks):
    return [sum(r["loss"][i] for r in ranks) / len(ranks) for i in range(MORE)]


# (saving world, stage, offload, precision), (loading world, stage, offload, precision[, chunk
# size]): the micro-batch is 4 / world on each side.
CASES = [
    ("2r-s3-nvme_to_1r-s2-cpu", (2, 3, "nvme", "fp32"), (1, 2, "cpu", "fp32")),
    ("1r-s1_to_2r-s3-cpu", (1, 1, "none", "fp32"), (2, 3, "cpu", "fp32")),
    ("2r-s0_to_2r-s2", (2, 0, "none", "fp32"), (2, 2, "none", "fp32")),
    ("2r-s2-fp32_to_1r-s3-bf16", (2, 2, "cpu", "fp32"), (1, 3, "cpu", "bf16")),
    ("2r-s3-fp16_to_1r-s2-fp16", (2, 3, "cpu", "fp16"), (1, 2, "cpu", "fp16")),
    # Other chunks on as many ranks: each rank reads the saved shards its own overlap.
    ("2r-s3_to_2r-s3-other-chunks", (2, 3, "cpu", "fp32"), (2, 3, "cpu", "fp32", "12KiB")),
]

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _reads(log):
    """Per loading rank, (bytes read, bytes of the states it loads) from the load's log line."""
    found = {}
    for m in re.finditer(r"rank (\d+) read ([\d.]+) (\w+) of the checkpoint's ([\d.]+) (\w+)", log):
        found[int(m[1])] = (float(m[2]) * _UNITS[m[3]], float(m[4]) * _UNITS[m[5]])
    return found


@pytest.mark.skipif(not harness.have_gloo(),
                    reason="this build has no c10d Gloo (its headers were missing at build time)")
@pytest.mark.parametrize("name,saving,loading", CASES, ids=[c[0] for c in CASES])
def test_a_checkpoint_resumes_on_other_ranks_stage_and_precision(name, saving, loading, tmp_path):
    sw, ss, so, sb = saving
    lw, ls, lo, lb, *chunk = loading
    saved, _ = _run("save", sw, _config(ss, so, 4 // sw, tmp_path, sb), tmp_path)
    load_cfg = _config(ls, lo, 4 // lw, tmp_path, lb, chunk_size=chunk and chunk[0])
    loaded, log = _run("load", lw, load_cfg, tmp_path)
    # The load said what it converted.
    said = "loading its states parameter by parameter" if chunk else "Note [elastic resume]"
    assert said in log
    if chunk:
        # Loaded parameter by parameter on every rank, each reading well under the whole
        # checkpoint (its share, and the saved shards that straddle its own).
        reads = _reads(log)
        assert sorted(reads) == list(range(lw)), log[-3000:]
        for rank, (read, total) in reads.items():
            assert 0 < read < 0.75 * total, f"rank {rank} read {read} of {total}"
    assert loaded[0]["global_steps"] == saved[0]["global_steps"] == STEPS
    # fp16: the loss scale comes along (it doubled from 2^8 over the saved steps).
    assert loaded[0]["loss_scale"] == saved[0]["loss_scale"]
    assert sb != "fp16" or saved[0]["loss_scale"] > 2 ** 8
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert loaded[0][key].keys() == saved[0][key].keys()
        for pname, want in saved[0][key].items():
            assert loaded[0][key][pname] == want, f"{key} of {pname}"
    # Trained states, not fresh ones: the moments are not zero.
    assert any(v != 0 for vals in saved[0]["exp_avg"].values() for v in vals)
    want, got = _mean_loss(saved), _mean_loss(loaded)
    # 16-bit compute rounds every activation: the losses agree to its precision.
    harness.assert_close(got, want, rel=1e-5 if sb == lb == "fp32" else 2e-2, what="resumed loss")


@pytest.mark.skipif(not harness.have_gloo(),
                    reason="this build has no c10d Gloo (its headers were missing at build time)")
@pytest.mark.parametrize("loading_world", [2, 1])
def test_frozen_parameters_come_back_on_every_rank(loading_world, tmp_path):
    """Frozen parameters were not in checkpoints: a run resumed into a model built afresh kept
    that model's values for them. Rank 0 saves them once and every loading rank reads them from
    its file, whatever the world size; the run then goes on as the saved one."""
    frozen = ["embed.pos", "blocks.0.qkv.bias"]
    saved, _ = _run("save", 2, _config(3, "cpu", 2, tmp_path), tmp_path, freeze=frozen)
    loaded, _ = _run("load", loading_world, _config(3, "cpu", 4 // loading_world, tmp_path),
                     tmp_path, freeze=frozen, shift_frozen=1.0)
    assert sorted(saved[0]["frozen"]) == sorted(frozen)
    for r in range(loading_world):
        assert loaded[r]["frozen"] == saved[0]["frozen"], f"rank {r}"
        assert loaded[r]["master"] == saved[0]["master"], f"rank {r}"
    harness.assert_close(_mean_loss(loaded), _mean_loss(saved), rel=1e-5, what="resumed loss")


def test_a_checkpoint_with_a_client_optimizer_stays_on_its_ranks(tmp_path):
    """A client optimizer's state is per rank and opaque: another world size is refused, naming
    the fix, before anything is loaded."""
    import copy
    import torch
    import strata
    cfg = _config(0, "none", 2, tmp_path)  # stage 0 runs any optimizer as the client's
    del cfg["optimizer"]
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    engine, _, _, _ = strata.initialize(
        model=model, optimizer=torch.optim.RMSprop(model.parameters(), lr=1e-3),
        config=copy.deepcopy(cfg))
    harness.run_steps(engine, "gpt2", 0, 1)
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.close()
    # The same checkpoint as if two ranks had saved it: rank 0's manifest says world_size 2.
    [manifest] = (tmp_path / "ckpt").glob("*/step-*/rank-00000.json")
    m = json.loads(manifest.read_text())
    m["world_size"] = 2
    manifest.write_text(json.dumps(m))
    torch.manual_seed(0)
    model = harness.MODELS["gpt2"]()
    engine, _, _, _ = strata.initialize(
        model=model, optimizer=torch.optim.RMSprop(model.parameters(), lr=1e-3),
        config=copy.deepcopy(cfg))
    with pytest.raises(strata.StrataError, match="client optimizer's state is saved per rank"):
        engine.load_checkpoint(tmp_path / "ckpt")
    engine.close()
