#!/usr/bin/env python3
"""Where the Python module fails on a GPU: one small step at a time, each in its own process.

    PYTHONPATH=<build>/python python3 tools/scripts/gpu_python_probe.py [--out DIR] [--timeout S]

Each case builds a two-layer model, makes an engine with one config and trains two steps; a case
that dies of a signal is run again with the module's native backtrace on
(STRATA_NATIVE_BACKTRACE=1) and, where gdb or cuda-gdb is on the machine, under the debugger
too, and the frames' shared-object offsets are resolved with addr2line. Prints one line per case
and writes probe.json (and the logs) under --out. Used by `gpu-check.sh test` before the suites.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

# One case = (name, what it checks, config changes, code run before the engine).
CASES = [
    ("import", "the module imports after torch", None, ""),
    ("import_first", "the module imports before torch", None, "IMPORT_FIRST"),
    ("cpu_stage0", "an engine on the CPU device", {"device": "cpu", "stage": 0}, ""),
    ("cuda_stage0", "an engine on CUDA, ZeRO-0, nothing offloaded", {"device": "cuda", "stage": 0}, ""),
    ("cuda_stage0_torch_first", "the same after torch made its own CUDA context",
     {"device": "cuda", "stage": 0}, "torch.zeros(1, device='cuda')"),
    ("cuda_stage3_cpu", "CUDA, ZeRO-3, parameters and optimizer on the host",
     {"device": "cuda", "stage": 3, "offload": "cpu"}, ""),
    ("cuda_stage3_nvme", "CUDA, ZeRO-3, parameters and optimizer on NVMe",
     {"device": "cuda", "stage": 3, "offload": "nvme"}, ""),
]

CHILD = r'''
import json, os, sys
mode = sys.argv[1]
if mode == "IMPORT_FIRST":
    import strata._strata
    import torch
    print("PROBE-OK import order: _strata then torch", flush=True)
    raise SystemExit(0)
import torch
import strata
print("PROBE torch", torch.__version__, "cuda", torch.cuda.is_available(), flush=True)
spec = json.loads(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "null" else None
if spec is None:
    print("PROBE-OK import", flush=True)
    raise SystemExit(0)
exec(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] else None
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
off = spec.get("offload", "none")
z = {"stage": spec["stage"], "offload_optimizer": {"device": off}, "offload_param": {"device": off}}
if off == "nvme":
    z["offload_optimizer"]["nvme_path"] = z["offload_param"]["nvme_path"] = sys.argv[4]
if spec["stage"] < 3:
    z["offload_param"] = {"device": "none"}
cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": z,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "strata": {"device": spec["device"], "chunk_size": "16KiB"}}
print("PROBE initialize", json.dumps(cfg), flush=True)
engine, *_ = strata.initialize(model=model, config=cfg)
print("PROBE engine built on", engine.device, flush=True)
x = torch.randn(4, 32, device=engine.device)
y = torch.randint(0, 8, (4,), device=engine.device)
for _ in range(2):
    loss = torch.nn.functional.cross_entropy(engine(x), y)
    engine.backward(loss)
    engine.step()
print("PROBE-OK loss", float(loss), flush=True)
engine.close()
'''


def run(cmd, env, timeout):
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=timeout)
        return p.returncode, p.stdout.decode(errors="replace")
    except subprocess.TimeoutExpired as e:
        return "timeout", (e.stdout or b"").decode(errors="replace")


def resolve(text):
    """addr2line for every 'object(+0xOFF)' frame that backtrace_symbols printed without a name."""
    a2l = shutil.which("addr2line")
    if not a2l:
        return ""
    out = []
    for obj, off in re.findall(r"^(/[^\s(]+)\((?:[^)+]*)\+(0x[0-9a-f]+)\)", text, re.M):
        try:
            r = subprocess.run([a2l, "-f", "-C", "-i", "-e", obj, off], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, timeout=30)
            lines = r.stdout.decode(errors="replace").strip().splitlines()
            out.append(f"{os.path.basename(obj)}+{off}: " + " | ".join(lines[:6]))
        except (OSError, subprocess.TimeoutExpired):
            pass
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".", help="folder for probe.json and the logs")
    ap.add_argument("--timeout", type=float, default=90, help="seconds per case")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = []
    dbg = shutil.which("gdb") or shutil.which("cuda-gdb") or (
        "/usr/local/cuda/bin/cuda-gdb" if os.path.exists("/usr/local/cuda/bin/cuda-gdb") else None)
    for name, what, spec, pre in CASES:
        nvme = tempfile.mkdtemp(prefix="strata-probe-")
        mode = "IMPORT_FIRST" if pre == "IMPORT_FIRST" else "run"
        argv = [sys.executable, "-X", "faulthandler", "-c", CHILD, mode, json.dumps(spec),
                "" if mode != "run" else pre, nvme]
        env = dict(os.environ, PYTHONUNBUFFERED="1", STRATA_LOG_LEVEL="debug")
        rc, text = run(argv, env, args.timeout)
        r = {"case": name, "checks": what, "rc": rc, "ok": rc == 0 and "PROBE-OK" in text}
        log = os.path.join(args.out, f"probe-{name}.log")
        with open(log, "w") as f:
            f.write(text)
        if isinstance(rc, int) and rc < 0:  # died of a signal
            env2 = dict(env, STRATA_NATIVE_BACKTRACE="1")
            _, text2 = run(argv, env2, args.timeout)
            frames = resolve(text2)
            with open(log, "a") as f:
                f.write("\n===== again with STRATA_NATIVE_BACKTRACE=1 =====\n" + text2)
                f.write("\n===== addr2line =====\n" + frames + "\n")
            r["native_frames"] = frames.splitlines()[:25]
            if dbg:
                g = [dbg, "-q", "-batch", "-ex", "set pagination off", "-ex", "run",
                     "-ex", "bt 40", "-ex", "info sharedlibrary", "-ex", "thread apply all bt 12",
                     "--args"] + argv
                _, text3 = run(g, env, max(args.timeout, 120))
                with open(log, "a") as f:
                    f.write(f"\n===== under {dbg} =====\n" + text3)
                r["debugger_frames"] = [l[:240] for l in text3.splitlines() if re.match(r"#\d+ ", l)][:30]
        last = [l for l in text.splitlines() if l.startswith("PROBE") or "rror" in l][-3:]
        r["last_lines"] = last
        shutil.rmtree(nvme, ignore_errors=True)
        results.append(r)
        print(f"probe {name:26s} {'ok' if r['ok'] else 'FAILED rc=' + str(rc)}  ({what})", flush=True)
        for l in r.get("native_frames", [])[:12]:
            print("    " + l[:200], flush=True)
        for l in r.get("debugger_frames", [])[:12]:
            print("    " + l[:200], flush=True)
    with open(os.path.join(args.out, "probe.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
