#!/usr/bin/env python3
"""Trains a plain-PyTorch GPT-2-style model (examples/gpt2_model.py) on the fortunes text with a
DeepSpeed-style loop, through Strata.

    python3 examples/train_gpt2.py                                  # configs/tiny.json
    python3 examples/train_gpt2.py --config configs/nvme-offload.json --nvme-path /mnt/nvme
    strata-launch --nproc 2 -- python3 examples/train_gpt2.py --steps 50

The config is a DeepSpeed JSON file; its optional "model" section sizes the model (the same keys
strata-train reads, so the two train the same network). Tokens are bytes (vocabulary 256). The
script is what a DeepSpeed user already has: only the import line names Strata.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

import strata as deepspeed

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gpt2_model import GPT2  # noqa: E402

DEFAULT_CONFIG = os.path.join(os.path.dirname(HERE), "configs", "tiny.json")
DEFAULT_DATA = "/usr/share/games/fortunes"


def load_text(path):
    """All bytes of a text file, or of every file in a directory (sorted, .dat indexes skipped)."""
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if not f.endswith(".dat") and os.path.isfile(os.path.join(path, f))
                       and not os.path.islink(os.path.join(path, f)))
    elif os.path.isfile(path):
        files = [path]
    else:
        sys.exit(f"train_gpt2: --data {path} does not exist; pass a text file or directory "
                 "(the default comes with Debian's fortunes package)")
    data = b"".join(open(f, "rb").read() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def sample(text, batch, seq_len, generator):
    """A micro-batch of random windows: inputs and the next-byte targets."""
    starts = torch.randint(0, len(text) - seq_len - 1, (batch,), generator=generator)
    windows = torch.stack([text[s:s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG, help="DeepSpeed JSON (default: %(default)s)")
    p.add_argument("--data", default=DEFAULT_DATA, help="text file or directory (default: %(default)s)")
    p.add_argument("--steps", type=int, default=0,
                   help="optimizer steps (default: the scheduler's total_num_steps, else 200)")
    p.add_argument("--nvme-path", default="", help="overrides both offload nvme_path settings")
    p.add_argument("--log-every", type=int, default=10, help="print every N steps (default: 10)")
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="run every block through deepspeed.checkpointing.checkpoint")
    p.add_argument("--save", default="", help="save a checkpoint here at the end")
    p.add_argument("--resume", default="", help="load the latest checkpoint from here first")
    p.add_argument("--loss-csv", default="", help="write step,loss,lr,seconds per step here")
    args = p.parse_args()

    with open(args.config, encoding="utf-8") as f:
        config = json.load(f)
    if args.nvme_path:
        z = config.setdefault("zero_optimization", {})
        for key in ("offload_param", "offload_optimizer"):
            if key in z:
                z[key]["nvme_path"] = args.nvme_path
    m = config.get("model", {})
    seq_len = m.get("seq_len", 128)
    torch.manual_seed(m.get("seed", 1234))
    model = GPT2(vocab_size=m.get("vocab_size", 256), seq_len=seq_len,
                 d_model=m.get("d_model", 128), n_layers=m.get("n_layers", 4),
                 n_heads=m.get("n_heads", 4), dropout=m.get("dropout", 0.0),
                 checkpoint_fn=deepspeed.checkpointing.checkpoint
                 if args.checkpoint_activations or m.get("checkpoint_activations") else None)

    engine, optimizer, _, _ = deepspeed.initialize(model=model,
                                                   model_parameters=model.parameters(),
                                                   config=config)
    leader = engine.global_rank == 0
    steps = args.steps or config.get("scheduler", {}).get("params", {}).get("total_num_steps", 200)
    if args.resume:
        path, client = engine.load_checkpoint(args.resume)
        if leader and path:
            print(f"train_gpt2: resumed from {path} at step {engine.global_steps}")
    text = load_text(args.data)
    gen = torch.Generator().manual_seed(m.get("seed", 1234) * 1000 + engine.global_rank)
    micro = engine.train_micro_batch_size_per_gpu()
    accum = engine.gradient_accumulation_steps()
    if leader:
        # Under stage 3 a released parameter has 0 elements; ds_numel counts it (as in DeepSpeed).
        n = sum(getattr(p, "ds_numel", p.numel())
                for p in {id(p): p for p in model.parameters()}.values())
        print(f"train_gpt2: GPT-2-style, {n / 1e6:.3g} M params, {engine.world_size} rank(s), "
              f"ZeRO stage {engine.zero_optimization_stage()}, micro-batch {micro} x {accum}, "
              f"{len(text) / 1e6:.1f} MB of text; on {engine.device}, {deepspeed.host_description()}",
              flush=True)

    rows, times = [], []
    csv = open(args.loss_csv, "w", encoding="utf-8") if args.loss_csv and leader else None
    if csv:
        csv.write("step,loss,lr,seconds\n")
    while engine.global_steps < steps:
        t0 = time.perf_counter()
        total = 0.0
        for _ in range(accum):
            x, y = sample(text, micro, seq_len, gen)
            # The batch goes where the engine computes (a GPU when there is one), as in DeepSpeed.
            loss = engine(x.to(engine.device), targets=y.to(engine.device))
            engine.backward(loss)
            engine.step()
            total += loss.item() / accum
        dt = time.perf_counter() - t0
        times.append(dt)
        step = engine.global_steps
        lr = engine.last_report["lr"]
        rows.append((step, total))
        if csv:
            csv.write(f"{step},{total:.6f},{lr:.6g},{dt:.6f}\n")
        if leader and (step % args.log_every == 0 or step == steps):
            print(f"step {step:5d}  loss {total:.4f}  lr {lr:.3g}  {dt * 1000:.1f} ms/step",
                  flush=True)
    if csv:
        csv.close()
    if args.save:
        engine.save_checkpoint(args.save)
    if leader and rows:
        steady = times[2:] or times
        k = max(1, min(10, len(rows) // 4))
        print(f"train_gpt2: {len(rows)} steps, loss {statistics.mean(l for _, l in rows[:k]):.4f} "
              f"(first {k}) -> {statistics.mean(l for _, l in rows[-k:]):.4f} (last {k}); "
              f"median step {statistics.median(steady) * 1000:.1f} ms", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
