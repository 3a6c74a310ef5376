#!/usr/bin/env python3
"""PyTorch's own offload, beside Strata on the same model: FSDP2 (`fully_shard`) with
`CPUOffloadPolicy`, trained on the GPT that a Strata config describes.

The model is examples/gpt2_model.py, which has strata-train's shapes and parameter count; its
attention runs through `scaled_dot_product_attention` (strata-train's path on LibTorch 2.x).
Micro-batch, sequence length, AdamW settings, clipping and bf16 come from the same JSON that
strata-train reads, so one config drives both sides of a comparison.

    python3 tools/scripts/fsdp2_peer.py --config configs/bench-nvme.json --steps 6 --json out.json
    torchrun --nproc-per-node 2 tools/scripts/fsdp2_peer.py --config ... --device cpu

One process needs no launcher (an in-process store). Needs torch >= 2.6 (fully_shard and
CPUOffloadPolicy); on the CPU device the collectives are gloo's. Prints one JSON line per step
and a summary line; --json writes the summary to a file as well.
"""

import argparse
import json
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
import gpt2_model  # noqa: E402  (the repository's plain-PyTorch GPT)


def _fsdp2():
    """fully_shard, CPUOffloadPolicy and MixedPrecisionPolicy wherever this torch keeps them."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy,
                                                            fully_shard)
        except ImportError:
            sys.exit(f"fsdp2_peer: torch {torch.__version__} has no FSDP2 fully_shard with "
                     "CPUOffloadPolicy; it needs torch >= 2.6")
    return fully_shard, CPUOffloadPolicy, MixedPrecisionPolicy


def _cpu_stream_events():
    """torch 2.6's FSDP2 records and waits for events on its side streams, and torch.cpu.Stream
    (a placeholder) has neither call. CPU kernels run to completion on the calling thread, so an
    event there is always complete: give the placeholder a completed event and a no-op wait.
    Later torch releases carry their own; this fills only what is missing."""
    stream = torch.cpu.Stream
    if not hasattr(stream, "record_event"):
        stream.record_event = lambda self, event=None: event if event is not None else torch.cpu.Event()
    if not hasattr(stream, "wait_event"):
        stream.wait_event = lambda self, event: None


class SdpaBlock(gpt2_model.Block):
    """gpt2_model.Block with its attention through the fused kernel; same parameters."""

    def forward(self, x, mask=None):
        B, T, D = x.shape
        hd = D // self.n_heads
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.n_heads, hd).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, D)
        h = x + self.drop(self.proj(y))
        return h + self.drop(self.out(F.gelu(self.fc(self.ln2(h)))))


def build_model(m, checkpoint):
    model = gpt2_model.GPT2(vocab_size=m["vocab_size"], seq_len=m["seq_len"],
                            d_model=m["d_model"], n_layers=m["n_layers"], n_heads=m["n_heads"],
                            dropout=m.get("dropout", 0.0))
    for i, old in enumerate(model.blocks):
        new = SdpaBlock(m["d_model"], m["n_heads"], m.get("dropout", 0.0))
        new.load_state_dict(old.state_dict())
        model.blocks[i] = new
    if checkpoint:
        from torch.utils.checkpoint import checkpoint as ckpt
        model.checkpoint_fn = lambda block, x, mask: ckpt(block, x, mask, use_reentrant=False)
    return model


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a Strata/DeepSpeed JSON with a model section")
    p.add_argument("--steps", type=int, default=6, help="training steps (default 6)")
    p.add_argument("--warmup", type=int, default=1,
                   help="steps left out of the mean (default 1: the first step allocates)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--offload", choices=["cpu", "none"], default="cpu",
                   help="cpu: CPUOffloadPolicy (parameters, gradients and AdamW on the host)")
    p.add_argument("--bf16", choices=["config", "on", "off"], default="config",
                   help="bf16 compute (MixedPrecisionPolicy); default: the config's bf16.enabled")
    p.add_argument("--checkpoint-activations", choices=["config", "on", "off"], default="config")
    p.add_argument("--json", help="also write the summary object to this file")
    a = p.parse_args(argv)
    if a.steps <= a.warmup:
        p.error(f"--steps={a.steps} must exceed --warmup={a.warmup}")
    return a


def main(argv=None):
    a = parse_args(argv)
    with open(a.config, encoding="utf-8") as f:
        cfg = json.load(f)
    if "model" not in cfg:
        sys.exit(f"fsdp2_peer: {a.config} has no model section (strata-train's GPT shapes)")
    m = cfg["model"]
    micro = int(cfg.get("train_micro_batch_size_per_gpu", 1))
    opt = cfg.get("optimizer", {}).get("params", {})
    bf16 = cfg.get("bf16", {}).get("enabled", False) if a.bf16 == "config" else a.bf16 == "on"
    ckpt = (m.get("checkpoint_activations", False) if a.checkpoint_activations == "config"
            else a.checkpoint_activations == "on")

    fully_shard, CPUOffloadPolicy, MixedPrecisionPolicy = _fsdp2()
    cuda = torch.cuda.is_available() if a.device == "auto" else a.device == "cuda"
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(local)
    else:
        _cpu_stream_events()
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend)
    else:  # one process: an in-process store, no port
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")

    torch.manual_seed(int(m.get("seed", 1234)))
    model = build_model(m, ckpt)
    n_params = sum(p.numel() for p in model.parameters())
    kwargs = {}
    if a.offload == "cpu":
        # Pinned host memory exists only beside an accelerator: on the CPU device the offloaded
        # shards are plain host memory (the dry run's case).
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=cuda)
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    if not cuda:
        # On the CPU device torch 2.6's re-gather for backward writes into storage autograd saved
        # in forward ("modified by an inplace operation"): keep blocks gathered from forward to
        # backward there. On a GPU, blocks reshard after forward as FSDP2 does by default.
        kwargs["reshard_after_forward"] = False
    if a.offload == "none":
        model.to(device)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    if a.offload == "none":
        model.to(device)
    model.mask = model.mask.to(device)
    betas = tuple(opt.get("betas", (0.9, 0.999)))
    optim = torch.optim.AdamW(model.parameters(), lr=opt.get("lr", 1e-3), betas=betas,
                              eps=opt.get("eps", 1e-8), weight_decay=opt.get("weight_decay", 0.01))
    clip = float(cfg.get("gradient_clipping", 0.0))

    gen = torch.Generator().manual_seed(1000 + rank)
    times, losses = [], []
    for step in range(1, a.steps + 1):
        batch = torch.randint(0, m["vocab_size"], (micro, m["seq_len"] + 1), generator=gen)
        batch = batch.to(device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optim.step()
        optim.zero_grad(set_to_none=True)
        value = loss.item()  # waits for the step's compute
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        times.append(dt)
        losses.append(value)
        if rank == 0:
            print(json.dumps({"step": step, "loss": value, "step_time_s": round(dt, 4)}),
                  flush=True)
    if not all(math.isfinite(v) for v in losses):
        sys.exit(f"fsdp2_peer: non-finite loss {losses}")
    timed = times[a.warmup:]
    summary = {
        "summary": True, "peer": "fsdp2", "torch": torch.__version__,
        "device": torch.cuda.get_device_name(local) if cuda else "cpu", "world_size": world,
        "offload": a.offload, "bf16": bf16, "checkpoint_activations": ckpt,
        "params": n_params, "micro_batch": micro, "seq_len": m["seq_len"], "steps": a.steps,
        "mean_step_s": sum(timed) / len(timed), "min_step_s": min(timed),
        "last_loss": losses[-1], "peak_rss_bytes": peak_rss_bytes(),
        "peak_device_bytes": torch.cuda.max_memory_allocated(local) if cuda else None,
    }
    if rank == 0:
        print(json.dumps(summary), flush=True)
        if a.json:
            with open(a.json, "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
