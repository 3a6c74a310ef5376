"""Hugging Face's Trainer with `deepspeed=<config>`, and a hand-written accelerate loop with a
`DeepSpeedPlugin`, train on Strata through the `deepspeed` compatibility package, unchanged: a
small transformers GPT-2 built from a config (no download) gives the same per-step losses as the
same loop without DeepSpeed, evaluates, saves and resumes. Runs wherever transformers and
accelerate import (transformers 5.x needs torch >= 2.4: the lent GPU machines, and a Debian sid
root made by `tools/scripts/test-libtorch2.sh --hf`); elsewhere it reports itself skipped.

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
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or
    importlib.util.find_spec("accelerate") is None,
    reason="transformers or accelerate is not installed (they exist on the lent GPU machines and "
           "in the Debian sid root of tools/scripts/test-libtorch2.sh --hf)")

STEPS = 6
# What every runner starts with: its arguments, the token data, the small GPT-2's config.
PRELUDE = r'''
import json, os, sys
import torch
from transformers import GPT2Config

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


def small_gpt2_config():
    return GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
'''

RUNNER = PRELUDE + r'''
import transformers
from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

transformers.set_seed(0)
model = GPT2LMHeadModel(small_gpt2_config())
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

# accelerate's own loop as its docs write it: the client AdamW with a decay / no-decay split, a
# torch LambdaLR (linear warmup and decay) that accelerate keeps outside the engine, clipping,
# save_state after step 3, and load_state + skip_first_batches to resume.
ACCELERATE_RUNNER = PRELUDE + r'''
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import set_seed
from transformers import GPT2LMHeadModel, get_linear_schedule_with_warmup

set_seed(0)
model = GPT2LMHeadModel(small_gpt2_config())
decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
rest = [p for n, p in model.named_parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                               {"params": rest, "weight_decay": 0.0}], lr=1e-3)
scheduler = get_linear_schedule_with_warmup(optimizer, 2, steps)
loader = torch.utils.data.DataLoader(Tokens(2 * steps, 1), batch_size=2, shuffle=False)
accelerator = (Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds)) if ds
               else Accelerator())
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
done = 0
if resume:
    accelerator.load_state(resume)
    done = 3
    loader = accelerator.skip_first_batches(loader, done)
losses = {}
model.train()
for step, batch in enumerate(loader, done + 1):
    loss = model(**batch).loss
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    losses[step] = loss.item()
    if step == 3 and not resume:
        accelerator.save_state(os.path.join(out, "state"))
with torch.no_grad():
    model.eval()
    eval_loss = sum(model(**b).loss.item() for b in
                    torch.utils.data.DataLoader(Tokens(8, 2), batch_size=2)) / 4
with open(os.path.join(out, "result.json"), "w") as f:
    json.dump({"losses": losses, "eval_loss": eval_loss}, f)
'''

# Two ranks, as transformers builds a model under ZeRO-3 outside the Trainer (its documented
# "non-Trainer integration"): an HfDeepSpeedConfig kept alive, then from_config, which constructs
# under zero.Init and initialises each module inside GatheredParameters(modifier_rank=0) on rank 0
# only, then ties the weights. The ranks seed differently, so rank 1's values survive nowhere
# unless the gather fails to broadcast rank 0's. Each rank saves the model it got (gathered) and
# trains it with deepspeed.initialize on its half of each global batch of 4.
# (The Trainer itself cannot run two ranks on a machine without GPUs: accelerate then opens no
# backend under DeepSpeed and counts one process, so its "auto" train_batch_size is half the
# real one, which real DeepSpeed refuses as Strata does.)
TWO_RANK_RUNNER = PRELUDE + r'''
import deepspeed
from transformers import AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig

rank = int(os.environ["RANK"])
keep = HfDeepSpeedConfig(ds)  # while it lives, from_config builds under zero.Init
deepspeed.init_distributed(dist_backend="nccl" if ds["strata"]["device"] == "cuda" else "gloo")
torch.manual_seed(1000 + rank)
model = AutoModelForCausalLM.from_config(small_gpt2_config())
with deepspeed.zero.GatheredParameters(list(model.parameters())):
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
               os.path.join(out, f"init-rank{rank}.pt"))
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                       config=ds)
data = torch.randint(0, 256, (4 * steps, 32), generator=torch.Generator().manual_seed(1))
losses = []
for step in range(steps):
    x = data[4 * step + 2 * rank: 4 * step + 2 * rank + 2].to(engine.device)
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
with open(os.path.join(out, f"result-rank{rank}.json"), "w") as f:
    json.dump(losses, f)
'''


# One process, a bf16 master: from_config under zero.Init builds the model in bf16 (Strata's
# default for that master, DeepSpeed's for every bf16 config), transformers initialises it in
# bf16, and deepspeed.initialize trains it.
BF16_MASTER_RUNNER = PRELUDE + r'''
import deepspeed
from transformers import AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig

keep = HfDeepSpeedConfig(ds)  # while it lives, from_config builds under zero.Init
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(small_gpt2_config())
dtypes = sorted({str(p.dtype) for p in model.parameters()})
with deepspeed.zero.GatheredParameters(list(model.parameters())):
    torch.save({n: p.detach().float().clone() for n, p in model.named_parameters()},
               os.path.join(out, "init.pt"))
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                       config=ds)
data = (torch.arange(32) % 8).repeat(2 * steps, 1)  # one 8-token cycle: learnt in a few steps
losses = {}
for step in range(steps):
    x = data[2 * step: 2 * step + 2].to(engine.device)
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    losses[step + 1] = loss.item()
with open(os.path.join(out, "result.json"), "w") as f:
    json.dump({"losses": losses, "dtypes": dtypes}, f)
'''

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tmp_path, name, ds, resume="", runner=RUNNER):
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1",
               # The plain reference makes accelerate open a torch process group, whose TCPStore
               # needs this where torch is built without libuv (Debian's); pip's torch takes it too.
               USE_LIBUV="0")
    compat = os.environ.get("STRATA_DS_COMPAT", "")
    if ds:
        if not compat or not os.path.isdir(compat):
            pytest.fail("STRATA_DS_COMPAT does not name the build's deepspeed-compat folder: run "
                        "through ctest, or export STRATA_DS_COMPAT=<build>/deepspeed-compat")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (compat, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", runner, str(out), json.dumps(ds), resume,
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
            nvme_dir.mkdir(parents=True, exist_ok=True)  # Strata refuses a missing nvme_path
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
    ds = ds_config(stage, offload, tmp_path / "nvme", False)
    got = run(tmp_path, "strata", ds)
    assert sorted(got["losses"]) == list(range(1, STEPS + 1))
    for step, loss in plain["losses"].items():
        assert got["losses"][step] == pytest.approx(loss, rel=1e-4), f"step {step}"
    assert got["eval_loss"] == pytest.approx(plain["eval_loss"], rel=1e-4)
    # The Trainer saves its LambdaLR beside the engine's checkpoint and restores both.
    # (Steps 1-3 of its log come back from the checkpoint's trainer_state.json.)
    resumed = run(tmp_path, "resumed", ds, resume=str(got["dir"] / "run" / "checkpoint-3"))
    for step in range(4, STEPS + 1):
        assert resumed["losses"][step] == pytest.approx(got["losses"][step], rel=1e-6), step


def test_the_configs_optimizer_and_warmup_train_and_resume(tmp_path):
    ds = ds_config(3, "cpu", tmp_path / "nvme", True)
    straight = run(tmp_path, "straight", ds)
    assert straight["losses"][STEPS] < straight["losses"][1]
    checkpoint = straight["dir"] / "run" / "checkpoint-3"
    assert checkpoint.is_dir(), sorted(p.name for p in (straight["dir"] / "run").iterdir())
    resumed = run(tmp_path, "resumed", ds, resume=str(checkpoint))
    for step in range(4, STEPS + 1):
        assert resumed["losses"][step] == pytest.approx(straight["losses"][step], rel=1e-6), step


def accelerate_config(stage, offload, nvme_dir):
    # The micro-batch stays "auto": accelerate fills it from the loader passed to the same prepare.
    cfg = ds_config(stage, offload, nvme_dir, False)
    del cfg["train_batch_size"]
    cfg.update(gradient_accumulation_steps=1, gradient_clipping=1.0)
    return cfg


@pytest.fixture(scope="module")
def plain_accelerate(tmp_path_factory):
    """The same accelerate loop without a DeepSpeedPlugin: the reference."""
    return run(tmp_path_factory.mktemp("plain_acc"), "plain", {}, runner=ACCELERATE_RUNNER)


@pytest.mark.parametrize("stage, offload", [(2, "none"), (3, "cpu")])
def test_an_accelerate_loop_with_a_deepspeed_plugin_matches_plain_accelerate_and_resumes(
        plain_accelerate, tmp_path, stage, offload):
    ds = accelerate_config(stage, offload, tmp_path / "nvme")
    straight = run(tmp_path, "straight", ds, runner=ACCELERATE_RUNNER)
    assert sorted(straight["losses"]) == list(range(1, STEPS + 1))
    for step, loss in plain_accelerate["losses"].items():
        assert straight["losses"][step] == pytest.approx(loss, rel=1e-4), f"step {step}"
    assert straight["eval_loss"] == pytest.approx(plain_accelerate["eval_loss"], rel=1e-4)
    state = straight["dir"] / "state"
    assert state.is_dir(), sorted(p.name for p in straight["dir"].iterdir())
    resumed = run(tmp_path, "resumed", ds, resume=str(state), runner=ACCELERATE_RUNNER)
    assert sorted(resumed["losses"]) == list(range(4, STEPS + 1))
    for step in range(4, STEPS + 1):
        assert resumed["losses"][step] == pytest.approx(straight["losses"][step], rel=1e-6), step


def run_two_ranks(out, ds):
    out.mkdir(exist_ok=True)
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               PYTHONUNBUFFERED="1", USE_LIBUV="0")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.environ.get("STRATA_DS_COMPAT", ""), env.get("PYTHONPATH", "")) if p)
    procs = [subprocess.Popen([sys.executable, "-c", TWO_RANK_RUNNER, str(out), json.dumps(ds),
                               "", str(STEPS)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r}:\n" + logs[r][-6000:]
    losses = []
    for r in range(2):
        with open(out / f"result-rank{r}.json", encoding="utf-8") as f:
            losses.append(json.load(f))
    return losses


def plain_losses(init, data, rows):
    """Plain fp32 torch, no DeepSpeed: the small GPT-2 from the values `init`, trained with AdamW
    (lr 1e-3, weight decay 0.01) on `rows` rows of `data` per step; each step's loss."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2,
                                       n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(init[n])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        x = data[rows * step: rows * step + rows]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses

def test_two_ranks_build_under_zero_init_initialise_on_rank_0_and_train_as_one_batch(tmp_path):
    if not os.path.isdir(os.environ.get("STRATA_DS_COMPAT", "")):
        pytest.fail("STRATA_DS_COMPAT does not name the build's deepspeed-compat folder")
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
          # Two ranks sharing one GPU is refused by NCCL: below two GPUs, the CPU device.
          "strata": {"chunk_size": "64KiB",
                     "device": "cuda" if torch.cuda.device_count() >= 2 else "cpu"}}
    losses = run_two_ranks(tmp_path, ds)
    init = [torch.load(tmp_path / f"init-rank{r}.pt") for r in range(2)]
    assert init[0].keys() == init[1].keys()
    for name in init[0]:
        assert torch.equal(init[0][name], init[1][name]), name
    # transformers' GPT-2 init, as rank 0 ran it: token embeddings ~ N(0, 0.02), norms at 1.
    assert 0.015 < init[0]["transformer.wte.weight"].std().item() < 0.025
    assert torch.equal(init[0]["transformer.ln_f.weight"], torch.ones(64))

    # The reference: one process, plain torch, rank 0's init, each step's 4 rows at once (the mean
    # of the two ranks' losses over 2 rows each is the mean over 4: every row has 31 labels).
    data = torch.randint(0, 256, (4 * STEPS, 32), generator=torch.Generator().manual_seed(1))
    for step, want in enumerate(plain_losses(init[0], data, 4)):
        got = (losses[0][step] + losses[1][step]) / 2
        assert got == pytest.approx(want, rel=1e-4), f"step {step + 1}"


def test_a_bf16_master_config_builds_in_bf16_under_zero_init_and_trains(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
          "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
          "strata": {"chunk_size": "64KiB", "stochastic_rounding": False}}
    r = run(tmp_path, "bf16", ds, runner=BF16_MASTER_RUNNER)
    assert r["dtypes"] == ["torch.bfloat16"]  # what DeepSpeed's bf16 zero.Init gives too
    init = torch.load(r["dir"] / "init.pt")
    # transformers' GPT-2 init, drawn in bf16: embeddings ~ N(0, 0.02), norms at 1.
    assert 0.015 < init["transformer.wte.weight"].std().item() < 0.025
    assert torch.equal(init["transformer.ln_f.weight"], torch.ones(64))
    # The reference: plain fp32 torch from the same initial values, on the runner's data (an
    # 8-token cycle, which it learns from about 5.5 to 4.3 in six steps). bf16 compute and a bf16
    # master with nearest rounding follow it to bf16's precision.
    want = plain_losses(init, (torch.arange(32) % 8).repeat(2 * STEPS, 1), 2)
    assert want[0] - want[-1] > 0.8, want
    for step in range(STEPS):
        assert r["losses"][step + 1] == pytest.approx(want[step], rel=2e-2), f"step {step + 1}"
