"""Hugging Face's Trainer with `deepspeed=<config>` trains on Strata through the `deepspeed`
compatibility package, unchanged: a small transformers GPT-2 built from a config (no download)
gives the same per-step losses as the same Trainer without DeepSpeed, evaluates, saves and
resumes. Runs wherever transformers imports (the lent GPU machines: transformers 5.x needs torch
>= 2.4, which no Debian release here has); elsewhere it reports itself skipped.

Each case runs in a subprocess (tools below) so that the environment a launcher would set
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*) and `deepspeed` resolving to Strata hold from the first
import, as they do for a user's `deepspeed train.py` run.
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (it exists on the lent GPU "
                                       "machines only)")

STEPS = 6
RUNNER = r'''
import json, os, sys
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

out, ds, resume = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
steps = int(sys.argv[4])


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, 256, (n, 32), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


transformers.set_seed(0)
cfg = GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = GPT2LMHeadModel(cfg)
args = TrainingArguments(output_dir=os.path.join(out, "run"), max_steps=steps,
                         per_device_train_batch_size=2, per_device_eval_batch_size=2,
                         learning_rate=1e-3, weight_decay=0.01, warmup_steps=2,
                         logging_steps=1, save_strategy="steps", save_steps=3,
                         report_to="none", disable_tqdm=True, seed=0, data_seed=0,
                         deepspeed=ds or None)
trainer = Trainer(model=model, args=args, train_dataset=Tokens(64, 1), eval_dataset=Tokens(8, 2))
trainer.train(resume_from_checkpoint=resume or None)
losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
metrics = trainer.evaluate()
with open(os.path.join(out, "result.json"), "w") as f:
    json.dump({"losses": losses, "eval_loss": metrics["eval_loss"]}, f)
'''


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tmp_path, name, ds, resume=""):
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1")
    compat = os.environ.get("STRATA_DS_COMPAT", "")
    if ds:
        if not compat or not os.path.isdir(compat):
            pytest.fail("STRATA_DS_COMPAT does not name the build's deepspeed-compat folder: run "
                        "through ctest, or export STRATA_DS_COMPAT=<build>/deepspeed-compat")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (compat, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(out), json.dumps(ds), resume,
                           str(STEPS)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(out / "result.json", encoding="utf-8") as f:
        r = json.load(f)
    r["losses"] = {int(k): v for k, v in r["losses"].items()}
    r["dir"] = out
    return r


def ds_config(stage, offload, nvme_dir, with_optimizer):
    z = {"stage": stage}
    if offload != "none":
        z["offload_optimizer"] = {"device": offload}
        if offload == "nvme":
            z["offload_optimizer"]["nvme_path"] = str(nvme_dir)
        if stage == 3:
            z["offload_param"] = dict(z["offload_optimizer"])
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": z,
           "strata": {"chunk_size": "64KiB"}}
    if with_optimizer:
        # HF's own test configs: AdamW and WarmupLR from the config, every value "auto".
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
                                                        "eps": "auto", "weight_decay": "auto"}}
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                           "warmup_max_lr": "auto",
                                                           "warmup_num_steps": "auto"}}
    return cfg


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The same Trainer without DeepSpeed: the reference."""
    return run(tmp_path_factory.mktemp("plain"), "plain", {})


@pytest.mark.parametrize("stage, offload", [(2, "none"), (3, "cpu"), (3, "nvme")])
def test_the_trainers_own_optimizer_and_scheduler_match_plain_training(plain, tmp_path, stage,
                                                                       offload):
    # The Trainer's AdamW (two groups: no decay for biases and norms) and its LambdaLR with
    # warmup, stepped by the Trainer on that AdamW's groups.
    got = run(tmp_path, "strata", ds_config(stage, offload, tmp_path / "nvme", False))
    assert sorted(got["losses"]) == list(range(1, STEPS + 1))
    for step, loss in plain["losses"].items():
        assert got["losses"][step] == pytest.approx(loss, rel=1e-4), f"step {step}"
    assert got["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-4)


def test_the_configs_optimizer_and_warmup_train_and_resume(tmp_path):
    ds = ds_config(3, "cpu", tmp_path / "nvme", True)
    straight = run(tmp_path, "straight", ds)
    assert straight["losses"][STEPS] < straight["losses"][1]
    checkpoint = straight["dir"] / "run" / "checkpoint-3"
    assert checkpoint.is_dir(), sorted(p.name for p in (straight["dir"] / "run").iterdir())
    resumed = run(tmp_path, "resumed", ds, resume=str(checkpoint))
    for step in range(4, STEPS + 1):
        assert resumed["losses"][step] == pytest.approx(straight["losses"][step], rel=1e-6), step
