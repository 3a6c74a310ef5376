"""tools/scripts/gpu-check.sh and its JSON helper, on the parts that need no GPU: the configs it
trains, the way it reads strata-train's and the FSDP2 peer's output (means over the steps after
the first, the lane that bounds a step, the ratio against the peer), the report, and its refusals
of bad arguments. The phases themselves run on a GPU machine, or as a dry run with --device cpu."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "scripts", "gpu-check.sh")
spec = importlib.util.spec_from_file_location(
    "gpu_check_util", os.path.join(ROOT, "tools", "scripts", "gpu_check_util.py"))
util = importlib.util.module_from_spec(spec)
spec.loader.exec_module(util)


def step(n, step_s, compute, optimizer, nvme=0.0, peak_device=0, loss=5.0):
    return {"step": n, "loss": loss, "step_time_s": step_s, "compute_s": compute, "copy_s": 0.01,
            "comm_s": 0.0, "nvme_s": nvme, "optimizer_s": optimizer, "overlap": 0.5,
            "peak_device_bytes": peak_device, "peak_host_bytes": 1 << 30,
            "bytes_host_to_nvme": 100 * n, "bytes_nvme_to_host": 0}


def write_run(path, steps, params=404_000_000):
    with open(path, "w") as f:
        f.write("strata-train: a log line that is not JSON\n")
        for s in steps:
            f.write(json.dumps(s) + "\n")
        f.write(json.dumps({"summary": True, "parameters": params, "peak_rss_bytes": 7 << 30,
                            "tokens_per_s": 100.0, "mean_step_time_s": 1.0}) + "\n")


def test_train_summary_means_the_steps_after_the_first_and_names_the_bounding_lane(tmp_path):
    run = tmp_path / "train-cpu-fp32.jsonl"
    write_run(run, [step(1, 9.0, 8.0, 0.5, peak_device=5),
                    step(2, 1.0, 0.2, 0.8, peak_device=7),
                    step(3, 2.0, 0.4, 1.6, peak_device=6, loss=4.25)])
    r = util.summarize_train(str(run))
    assert r["ok"] and r["steps"] == 3
    assert r["step_s"] == pytest.approx(1.5)          # (1.0 + 2.0) / 2: step 1 left out
    assert r["compute_s"] == pytest.approx(0.3)
    assert r["optimizer_s"] == pytest.approx(1.2)
    assert r["bound_by"] == "optimizer"
    assert r["peak_device_bytes"] == 7                # the peak over every step, the first too
    assert r["bytes_host_to_nvme"] == pytest.approx(250)
    assert r["loss"] == 4.25 and r["params"] == 404_000_000


def test_a_run_without_a_summary_is_not_ok(tmp_path):
    run = tmp_path / "x.jsonl"
    run.write_text(json.dumps(step(1, 1.0, 0.5, 0.2)) + "\n")
    assert util.summarize_train(str(run))["ok"] is False


def test_bench_json_ratio_against_the_peer_and_failures_named(tmp_path):
    write_run(tmp_path / "train-cpu-fp32.jsonl", [step(1, 3.0, 1, 1), step(2, 0.3, 0.1, 0.25),
                                                  step(3, 0.5, 0.1, 0.45)])
    (tmp_path / "train-nvme-fp32.jsonl").write_text("")
    (tmp_path / "train-nvme-fp32.err").write_text("loading\nnvme path /x has 1 GiB free but ...\n")
    (tmp_path / "peer-fsdp2-cpu-fp32.jsonl").write_text(
        json.dumps({"step": 1, "loss": 5.0}) + "\n" +
        json.dumps({"summary": True, "mean_step_s": 1.6, "params": 404_000_000}) + "\n")
    (tmp_path / "peer-fsdp2-cpu-bf16.jsonl").write_text("")
    (tmp_path / "peer-fsdp2-cpu-bf16.err").write_text("fsdp2_peer: torch 1.13.1 has no FSDP2\n")
    (tmp_path / "profile.json").write_text(json.dumps({
        "device": "cuda", "nvme": {"points": [{"op": "read", "gbps": 5.0}, {"op": "read", "gbps": 6.5},
                                              {"op": "write", "gbps": 3.0}],
                                   "fio": {"op": "read", "gbps": 6.8}},
        "dram": {"copy_gbps": 20.0},
        "copies": [{"device": "cuda", "memory": "pinned", "direction": "h2d", "gbps": 25.0}],
        "adam": {"gelems_per_s": 1.5}, "compute": {"device": "cuda", "dtype": "bf16", "gflops": 700000.0}}))
    out = tmp_path / "bench.json"
    with open(out, "w") as f:
        subprocess.run([sys.executable, util.__file__, "bench-json", str(tmp_path)], check=True, stdout=f)
    b = json.loads(out.read_text())
    assert b["ok"] is False                           # one run failed
    assert b["runs"]["nvme-fp32"]["error"].startswith("nvme path /x has 1 GiB free")
    assert b["ratios"]["strata cpu / FSDP2 CPUOffload step (fp32)"] == pytest.approx(0.4 / 1.6)
    assert b["peers"]["fsdp2-cpu-bf16"] == {"ok": False, "error": "fsdp2_peer: torch 1.13.1 has no FSDP2"}
    c = b["ceilings"]
    assert c["nvme_read_gbps"] == 6.5 and c["fio_read_gbps"] == 6.8
    assert c["cuda_h2d_pinned_gbps"] == 25.0 and c["matmul_bf16_gflops"] == 700000.0
    assert c["matmul_device"] == "cuda"


def test_configs_place_every_state_as_asked(tmp_path):
    base = os.path.join(ROOT, "configs", "bench-nvme.json")
    for place in ("none", "cpu", "nvme"):
        out = tmp_path / f"{place}.json"
        util.main(["config", base, str(out), "--placement", place, "--dtype", "bf16",
                   "--device", "cuda", "--nvme-path", "/scratch/swap", "--host-budget", "64GiB",
                   "--model", "24,2048,16,2048", "--micro-batch", "8", "--checkpoint-activations"])
        c = json.loads(out.read_text())
        z = c["zero_optimization"]
        assert z["stage"] == 3
        assert z["offload_param"]["device"] == place and z["offload_optimizer"]["device"] == place
        assert ("nvme_path" in z["offload_optimizer"]) == (place == "nvme")
        assert c["bf16"] == {"enabled": True}
        assert c["strata"]["host_memory_budget"] == "64GiB" and c["strata"]["device"] == "cuda"
        assert c["model"]["n_layers"] == 24 and c["model"]["seq_len"] == 2048
        assert c["model"]["checkpoint_activations"] is True
        assert c["train_micro_batch_size_per_gpu"] == 8
        assert c["optimizer"] == json.load(open(base))["optimizer"]  # the rest is the base's
        # Without offload every state lives on the device: the whole device, not the base's 4 GiB.
        want = 0 if place == "none" else json.load(open(base))["strata"]["device_memory_budget"]
        assert c["strata"]["device_memory_budget"] == want


def test_auto_configs_let_the_plan_fill_every_tier(tmp_path):
    # placement auto: both sections at nvme (the floors), no budgets from the base (the plan
    # measures the machine), the device reserve and the compact layout when asked.
    base = os.path.join(ROOT, "configs", "bench-nvme.json")
    out = tmp_path / "auto.json"
    util.main(["config", base, str(out), "--placement", "auto", "--dtype", "bf16", "--device", "cuda",
               "--nvme-path", "/scratch/swap", "--model", "44,6144,48,2048", "--device-reserve", "123456",
               "--state-dtype", "int8", "--bf16-master"])
    c = json.loads(out.read_text())
    z, st = c["zero_optimization"], c["strata"]
    assert z["offload_param"] == z["offload_optimizer"] == {"device": "nvme", "nvme_path": "/scratch/swap"}
    assert st["placement"] == "auto" and st["device_reserve"] == 123456
    assert "device_memory_budget" not in st and "host_memory_budget" not in st
    assert st["optimizer_state_dtype"] == "int8"
    assert c["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True}


def test_scale_sizes_are_the_gpt3_shapes():
    # 12·L·d² parameters in the blocks: 1.2B, 2.5B, 6.4B, 12.6B; then 19.9B, 30.6B, 33.7B, 39.0B.
    expected = {"1.3b": 1.2e9, "2.7b": 2.5e9, "6.7b": 6.4e9, "13b": 12.6e9, "20b": 19.9e9,
                "30b": 30.6e9, "34b": 33.7e9, "39b": 39.0e9}
    for name, params in expected.items():
        layers, d, heads = util.SCALE_SIZES[name]
        assert 12 * layers * d * d == pytest.approx(params, rel=0.02)
        assert d % heads == 0


def test_report_has_a_row_per_run(tmp_path):
    (tmp_path / "build.json").write_text(json.dumps({"ok": True, "seconds": 300, "notes": "built",
                                                     "machine": "a test machine"}))
    (tmp_path / "scale.json").write_text(json.dumps({
        "ok": True, "seconds": 500, "notes": "", "largest": "13b (12.6B params)",
        "runs": [{"size": "13b", "placement": "nvme", "params": 12.6e9, "step_s": 30.0,
                  "tflops": 250.0, "bound_by": "compute", "result": "trained"},
                 {"size": "6.7b", "placement": "cpu", "result": "does not fit: host needs 200 GiB"}]}))
    md = subprocess.run([sys.executable, util.__file__, "report", str(tmp_path)], check=True,
                        capture_output=True, text=True).stdout
    assert "Machine: a test machine" in md
    assert "| build | yes | 300 |" in md
    assert "| test | not run |" in md
    assert "| 13b | nvme | 1.26e+10 | 30 | 250 | compute |" in md
    assert "does not fit: host needs 200 GiB" in md
    assert "Largest trained: 13b (12.6B params)." in md


@pytest.mark.parametrize("args, message", [
    ([], "build, pip, test, bench, scale"),
    (["deploy"], "unknown phase 'deploy'"),
    (["bench", "--device", "tpu"], "--device=tpu: cuda or cpu"),
    (["bench", "--steps", "0"], "--steps=0"),
    (["bench", "--fast"], "unknown flag '--fast'"),
])
def test_bad_arguments_exit_2_naming_them(args, message):
    p = subprocess.run(["bash", SCRIPT] + args, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert message in p.stdout + p.stderr


def test_phases_after_build_say_build_first(tmp_path):
    env = dict(os.environ, STRATA_GPU_BUILD=str(tmp_path / "b"), OUT=str(tmp_path / "out"))
    p = subprocess.run(["bash", SCRIPT, "bench", "--device", "cpu"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 1
    assert "run the build phase first" in p.stdout + p.stderr
    j = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert j["ok"] is False and j["phase"] == "bench"


def test_largest_is_the_trained_run_with_most_parameters(capsys):
    runs = [{"size": "1.3b", "params": 1.2e9, "placement": "cpu", "tflops": 180.0, "result": "trained"},
            {"size": "13b", "placement": "cpu", "result": "does not fit: host needs 293 GiB of 128 GiB"},
            {"size": "6.7b", "params": 6.4e9, "placement": "nvme", "tflops": 90.5, "result": "trained"},
            {"size": "13b", "params": 12.6e9, "placement": "nvme", "result": "failed: out of memory"}]
    util.main(["largest", json.dumps(runs)])
    assert capsys.readouterr().out.strip() == "6.7b (6.40B params, nvme offload, 90.5 TFLOPS)"
    util.main(["largest", json.dumps(runs[1:2])])
    assert capsys.readouterr().out == ""


@pytest.mark.skipif("STRATA_BIN" not in os.environ, reason="needs the build's strata-tune")
def test_the_tuners_prediction_of_each_offloaded_row_is_matched_by_placement_and_aio(tmp_path):
    """The bench phase runs strata-tune on the cpu row's config with the machine's profile; the
    helper finds the candidate of each measured row (the nvme row's at its aio setting) in the
    tuner's real output and sets the measured step beside the predicted one."""
    work = tmp_path
    cfgs = {}
    for place in ("cpu", "nvme"):
        out = work / f"cfg-{place}-bf16.json"
        util.main(["config", os.path.join(ROOT, "configs", "bench-nvme.json"), str(out),
                   "--placement", place, "--dtype", "bf16", "--device", "cpu",
                   "--nvme-path", str(work / "nvme"), "--host-budget", "2GiB",
                   "--model", "2,256,4,128", "--micro-batch", "2"])
        cfgs[place] = json.loads(out.read_text())
    aio = cfgs["nvme"]["aio"]
    points = [{"op": op, "block_size": bs, "queue_depth": 32, "intra_op_parallelism": 1, "gbps": g}
              for op, g in (("read", 2.0), ("write", 1.5)) for bs in (1 << 20, aio["block_size"])]
    (work / "profile.json").write_text(json.dumps({
        "device": "cpu", "nvme": {"path": str(work), "engine": "io_uring", "points": points},
        "dram": {"copy_gbps": 10.0},
        "copies": [{"device": "cpu", "memory": "pinned", "direction": d, "gbps": 8.0} for d in ("h2d", "d2h")],
        "adam": {"gelems_per_s": 1.0}, "compute": {"device": "cpu", "dtype": "bf16", "gflops": 50.0}}))
    tune = os.path.join(os.environ["STRATA_BIN"], "strata-tune")
    with open(work / "tune-bf16.json", "w") as f:
        subprocess.run([tune, "--config", str(work / "cfg-cpu-bf16.json"), "--profile", str(work / "profile.json"),
                        "--device", "cpu", "--nvme-path", str(work / "nvme"), "--placement", "config",
                        "--dry-run", "--json", "--top", "100", "--no-calibrate"], check=True, stdout=f)
    runs = {"cpu-bf16": {"ok": True, "step_s": 0.5}, "nvme-bf16": {"ok": True, "step_s": 2.0}}
    preds = util.tuner_predictions(str(work), runs)
    assert set(preds) == {"cpu-bf16", "nvme-bf16"}, preds
    assert preds["cpu-bf16"]["placement"] == "param=cpu optimizer=cpu"
    assert f"QD{aio['queue_depth']}" in preds["nvme-bf16"]["placement"]
    for name, p in preds.items():
        assert p["predicted_s"] > 0
        assert p["measured_over_predicted"] == pytest.approx(runs[name]["step_s"] / p["predicted_s"])
    # NVMe at the profile's 2 and 1.5 GB/s is slower than the host's copies: predicted so.
    assert preds["nvme-bf16"]["predicted_s"] > preds["cpu-bf16"]["predicted_s"]
    # The report shows them under the bench table.
    out = tmp_path / "out"
    out.mkdir()
    (out / "bench.json").write_text(json.dumps({"ok": True, "seconds": 60, "notes": "", "runs": {},
                                                "predictions": preds}))
    md = subprocess.run([sys.executable, util.__file__, "report", str(out)], check=True,
                        capture_output=True, text=True).stdout
    assert "strata-tune on this machine's profile" in md
    assert f"| cpu-bf16 | param=cpu optimizer=cpu | {util.fmt(preds['cpu-bf16']['predicted_s'])} | 0.5 |" in md
