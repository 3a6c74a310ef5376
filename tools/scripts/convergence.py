#!/usr/bin/env python3
"""The compact layouts' convergence benchmark (not a test): strata-train on the same text, seed
and batches under each optimizer-state layout, the validation loss every --eval-every steps, then
a Markdown table and an SVG plot of the curves.

  tools/scripts/convergence.py [--build DIR] [--config FILE] [--steps N] [--out DIR]
                               [--layouts NAME,...]

Layouts (bf16 compute in all of them; the gradient is fp32 in all of them):
  fp32           fp32 master, fp32 moments (12 bytes of optimizer state per parameter)
  bf16_moments   fp32 master, bf16 moments (8)
  bf16_nearest   bf16 master rounded to nearest, bf16 moments: DeepSpeed's
                 bf16_master_weights_and_grads + bf16_optimizer_states (4, the master being the
                 working copy)
  bf16_sr        the same with stochastic rounding: Strata's default for that config (4)
  int8           fp32 master, 8-bit blockwise moments (6.03)
  int8_bf16_sr   bf16 master with stochastic rounding, 8-bit moments (2.03)

Writes OUT/convergence.md, OUT/convergence.svg and OUT/<layout>.jsonl (strata-train --json).
Exit status: 0 every layout ran, 1 one failed (its log is named), 2 bad arguments.
"""

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYOUTS = {
    "fp32": ({}, {}),
    "bf16_moments": ({}, {"optimizer_state_dtype": "bf16"}),
    "bf16_nearest": ({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
                     {"stochastic_rounding": False}),
    "bf16_sr": ({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}, {}),
    "int8": ({}, {"optimizer_state_dtype": "int8"}),
    "int8_bf16_sr": ({"bf16_master_weights_and_grads": True}, {"optimizer_state_dtype": "int8"}),
}
COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]


def cpu_name():
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info = f.read()
        name = next(l.split(":", 1)[1].strip() for l in info.splitlines() if l.startswith("model name"))
        flags = next(l for l in info.splitlines() if l.startswith("flags"))
        isa = "AVX-512 with BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags \
            else "AVX2" if "avx2" in flags else "no AVX2"
        family = next((l.split(":")[1].strip() for l in info.splitlines() if l.startswith("cpu family")), "?")
        model = next((l.split(":")[1].strip() for l in info.splitlines() if l.startswith("model\t")), "?")
        return f"{name} (family {family} model {model}), {os.cpu_count()} cores, {isa}"
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def run_layout(name, base, args):
    bf16, strata = LAYOUTS[name]
    cfg = copy.deepcopy(base)
    cfg.setdefault("bf16", {}).update(bf16)
    cfg.setdefault("strata", {}).update(strata)
    cfg_path = os.path.join(args.out, f"{name}.json")
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    log_path = os.path.join(args.out, f"{name}.log")
    cmd = [os.path.join(args.build, "bin", "strata-train"), "--config", cfg_path,
           "--steps", str(args.steps), "--eval-every", str(args.eval_every),
           "--eval-batches", str(args.eval_batches), "--json", "--plot", ""]
    start = time.time()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    if proc.returncode != 0:
        print(f"convergence: {name} failed (exit {proc.returncode}); see {log_path}", file=sys.stderr)
        return None
    with open(os.path.join(args.out, f"{name}.jsonl"), "w", encoding="utf-8") as f:
        f.write(proc.stdout)
    curve = []
    for line in proc.stdout.splitlines():
        row = json.loads(line)
        if "val_loss" in row and "step" in row:
            curve.append((row["step"], row["val_loss"]))
    print(f"convergence: {name}: {len(curve)} validations, final {curve[-1][1]:.4f}, "
          f"{time.time() - start:.0f} s", file=sys.stderr)
    return curve


def svg(curves, path, title):
    w, h, left, right, top, bottom = 760, 440, 70, 170, 40, 50
    steps = [s for c in curves.values() for s, _ in c]
    # The interesting part: from the first validation after warm-up to the end.
    losses = [v for c in curves.values() for s, v in c if s >= max(steps) * 0.1]
    x0, x1 = 0, max(steps)
    y0, y1 = min(losses) - 0.02, max(losses) + 0.02
    sx = lambda s: left + (s - x0) / (x1 - x0) * (w - left - right)
    sy = lambda v: top + (y1 - min(max(v, y0), y1)) / (y1 - y0) * (h - top - bottom)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2 - right / 2}" y="22" text-anchor="middle" font-size="14">{title}</text>']
    for i in range(6):
        v = y0 + (y1 - y0) * i / 5
        out.append(f'<line x1="{left}" x2="{w - right}" y1="{sy(v):.1f}" y2="{sy(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{sy(v) + 4:.1f}" text-anchor="end">{v:.3f}</text>')
    for i in range(5):
        s = x1 * i / 4
        out.append(f'<text x="{sx(s):.1f}" y="{h - bottom + 18}" text-anchor="middle">{int(s)}</text>')
    out.append(f'<text x="{(left + w - right) / 2}" y="{h - 12}" text-anchor="middle">optimizer step</text>')
    out.append(f'<text x="16" y="{(top + h - bottom) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {(top + h - bottom) / 2})">validation loss</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{w - left - right}" height="{h - top - bottom}" '
               f'fill="none" stroke="#444"/>')
    for i, (name, c) in enumerate(curves.items()):
        pts = " ".join(f"{sx(s):.1f},{sy(v):.1f}" for s, v in c)
        out.append(f'<polyline points="{pts}" fill="none" stroke="{COLOURS[i % 6]}" stroke-width="1.6"/>')
        y = top + 14 + 18 * i
        out.append(f'<line x1="{w - right + 12}" x2="{w - right + 32}" y1="{y - 4}" y2="{y - 4}" '
                   f'stroke="{COLOURS[i % 6]}" stroke-width="2"/>')
        out.append(f'<text x="{w - right + 38}" y="{y}">{name}</text>')
    out.append("</svg>")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(HERE, "build-ci", "cuda-auto"))
    ap.add_argument("--config", default=os.path.join(HERE, "configs", "convergence.json"))
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--out", default="convergence-out")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    args = ap.parse_args()
    names = [n for n in args.layouts.split(",") if n]
    bad = [n for n in names if n not in LAYOUTS]
    if bad:
        print(f"convergence: unknown layout(s) {bad}; choose from {list(LAYOUTS)}", file=sys.stderr)
        return 2
    if not os.access(os.path.join(args.build, "bin", "strata-train"), os.X_OK):
        print(f"convergence: no strata-train in {args.build}/bin (--build)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    with open(args.config, encoding="utf-8") as f:
        base = json.load(f)
    curves = {}
    for name in names:
        c = run_layout(name, base, args)
        if c is None:
            return 1
        curves[name] = c
    ref = curves.get("fp32")
    m = base["model"]
    lines = [f"Validation loss of strata-train (GPT {m['n_layers']} x {m['d_model']}, seq "
             f"{m['seq_len']}, {args.steps} steps, {os.path.basename(args.config)}), "
             f"on {cpu_name()}.", "",
             "| layout | " + " | ".join(f"step {s}" for s, _ in next(iter(curves.values()))[4::5]) +
             " | final | vs fp32 |",
             "|---|" + "---|" * (len(next(iter(curves.values()))[4::5]) + 2)]
    for name, c in curves.items():
        rel = f"{100 * (c[-1][1] - ref[-1][1]) / ref[-1][1]:+.2f} %" if ref else "-"
        lines.append(f"| {name} | " + " | ".join(f"{v:.4f}" for _, v in c[4::5]) +
                     f" | {c[-1][1]:.4f} | {rel} |")
    table = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "convergence.md"), "w", encoding="utf-8") as f:
        f.write(table)
    svg(curves, os.path.join(args.out, "convergence.svg"),
        f"Validation loss by optimizer-state layout ({args.steps} steps)")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
