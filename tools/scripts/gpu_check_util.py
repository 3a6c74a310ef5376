#!/usr/bin/env python3
"""The JSON side of tools/scripts/gpu-check.sh: makes the configs each phase trains, reads
strata-train's, strata-swapbench's and the FSDP2 peer's JSON lines into one summary per phase,
and writes the report's markdown table. Standard library only (it runs under whatever python3
the machine has).

    gpu_check_util.py config BASE OUT --placement cpu --dtype bf16 [--model L,D,H,T] ...
    gpu_check_util.py train-summary RUN.jsonl           # one strata-train --json run, summarized
    gpu_check_util.py report OUTDIR                     # OUTDIR/*.json -> markdown on stdout
"""

import argparse
import glob
import json
import math
import os
import sys

# GPT sizes for the scale phase: (name, layers, d_model, heads). 12·L·d² parameters in the
# blocks, as GPT-3's table sizes them (byte-level vocabulary: the embedding is negligible).
SCALE_SIZES = {
    "1.3b": (24, 2048, 16),
    "2.7b": (32, 2560, 32),
    "6.7b": (32, 4096, 32),
    "13b": (40, 5120, 40),
    # Beyond GPT-3's table: 44 blocks of width 6144 (19.9B), the compact layouts' target.
    "20b": (44, 6144, 48),
    # 38 blocks of width 8192 (30.6B), GPT-3's widest shape near the compact layouts' limit.
    "30b": (38, 8192, 64),
    # 107 blocks of width 5120 (33.7B): what `strata-estimate --largest` planned for the H100
    # machine (80 GiB device, 126 GiB host, 63 GiB free disk) with a bf16 master and 8-bit
    # moments at the scale phase's micro-batch 8 x 2048 while zero::Init's staging file held the
    # whole model at start.
    "34b": (107, 5120, 40),
    # 124 blocks of width 5120 (39.0B): the same plan since the large matrices are drawn as the
    # engine reads them instead of staged (Note [generated parameters] in zero_init.cc); one
    # layer more overflows the device (87.2 GiB at the step's peak).
    "39b": (124, 5120, 40),
    # For the CPU dry run: the same pipeline on shapes a 2-core box trains in seconds.
    "tiny": (2, 128, 4),
    "small": (4, 256, 4),
}


def make_config(a):
    with open(a.base, encoding="utf-8") as f:
        cfg = json.load(f)
    z = cfg.setdefault("zero_optimization", {})
    z["stage"] = 3
    st = cfg.setdefault("strata", {})
    if a.placement == "auto":
        # Every tier allowed (the sections are floors); the plan fills device, host and NVMe
        # under what the machine has: the base's budgets (sized for its own placement) go.
        st["placement"] = "auto"
        st.pop("device_memory_budget", None)
        st.pop("host_memory_budget", None)
        if a.device_reserve:
            st["device_reserve"] = int(a.device_reserve)
    for key in ("offload_param", "offload_optimizer"):
        section = {"device": "nvme" if a.placement == "auto" else a.placement}
        if section["device"] == "nvme":
            section["nvme_path"] = a.nvme_path
        z[key] = section
    cfg["bf16"] = {"enabled": a.dtype == "bf16"}
    cfg.pop("fp16", None)
    if a.host_budget:
        st["host_memory_budget"] = a.host_budget
    if a.device_budget:
        st["device_memory_budget"] = a.device_budget
    elif a.placement == "none":
        # Everything stays on the device: the base's budget (sized for offloaded runs) would refuse
        # the states; 0 is the whole device.
        st["device_memory_budget"] = 0
    if a.state_dtype:
        st["optimizer_state_dtype"] = a.state_dtype
    if a.bf16_master:
        cfg["bf16"]["bf16_master_weights_and_grads"] = True
    if a.chunk_size:
        st["chunk_size"] = a.chunk_size
    st["device"] = a.device
    m = cfg.setdefault("model", {})
    if a.model:
        layers, d, heads, seq = (int(x) for x in a.model.split(","))
        m.update(n_layers=layers, d_model=d, n_heads=heads, seq_len=seq)
    if a.micro_batch:
        cfg["train_micro_batch_size_per_gpu"] = a.micro_batch
    if a.checkpoint_activations:
        m["checkpoint_activations"] = True
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=1)
    return 0


def read_lines(path):
    steps, summary, errors = [], None, []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                errors.append(line[:200])
                continue
            if obj.get("summary"):
                summary = obj
            elif "step" in obj:
                steps.append(obj)
    return steps, summary, errors


LANES = ("compute_s", "copy_s", "comm_s", "nvme_s", "optimizer_s")


def summarize_train(path, skip_first=1):
    """strata-train --json: the mean of each lane over the steps after the first, the lane that
    bounds the step, and the peaks."""
    steps, summary, _ = read_lines(path)
    timed = steps[skip_first:] if len(steps) > skip_first else steps
    out = {"ok": summary is not None and bool(steps), "steps": len(steps)}
    if not timed:
        return out

    def mean(key):
        vals = [s[key] for s in timed if isinstance(s.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else None

    out["step_s"] = mean("step_time_s")
    for lane in LANES:
        out[lane] = mean(lane)
    lanes = {k: out[k] for k in LANES if out.get(k) is not None}
    out["bound_by"] = max(lanes, key=lanes.get).replace("_s", "") if lanes else None
    out["overlap"] = mean("overlap")
    out["loss"] = steps[-1].get("loss")
    out["peak_device_bytes"] = max((s.get("peak_device_bytes") or 0) for s in steps)
    out["peak_host_bytes"] = max((s.get("peak_host_bytes") or 0) for s in steps)
    out["bytes_host_to_nvme"] = sum((s.get("bytes_host_to_nvme") or 0) for s in timed) / len(timed)
    out["bytes_nvme_to_host"] = sum((s.get("bytes_nvme_to_host") or 0) for s in timed) / len(timed)
    if summary:
        out["params"] = summary.get("parameters")
        out["peak_rss_bytes"] = summary.get("peak_rss_bytes")
        out["tokens_per_s"] = summary.get("tokens_per_s")
        out["mean_step_time_s"] = summary.get("mean_step_time_s")
        out["host"] = summary.get("host")
    return out


def ceilings(profile_path):
    """strata-swapbench profile --json: the ceiling of each lane on this machine."""
    try:
        with open(profile_path, encoding="utf-8") as f:
            prof = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    out = {}
    pts = prof.get("nvme", {}).get("points", [])
    for op in ("read", "write"):
        vals = [p["gbps"] for p in pts if p.get("op") == op]
        if vals:
            out[f"nvme_{op}_gbps"] = max(vals)
    fio = prof.get("nvme", {}).get("fio")
    if fio:
        out[f"fio_{fio.get('op')}_gbps"] = fio.get("gbps")
    out["dram_copy_gbps"] = prof.get("dram", {}).get("copy_gbps")
    for c in prof.get("copies", []):
        if c.get("device") == prof.get("device") or c.get("device") == "cuda":
            out[f"{c['device']}_{c['direction']}_{c['memory']}_gbps"] = c.get("gbps")
    adam = prof.get("adam", {})
    if adam:
        out["cpu_adam_gelems_per_s"] = adam.get("gelems_per_s")
    comp = prof.get("compute", {})
    if comp:
        out[f"matmul_{comp.get('dtype')}_gflops"] = comp.get("gflops")
        out["matmul_device"] = comp.get("device", "cpu")  # profiles before 2026-11-28: the CPU's
        if comp.get("fp32_gflops"):
            out["matmul_fp32_gflops"] = comp["fp32_gflops"]
    return out


def err_tail(path):
    """The last non-empty line of a run's stderr: what stopped it."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            tail = [line.strip() for line in f if line.strip()]
    except OSError:
        tail = []
    return tail[-1][:300] if tail else "no output"


def tuner_predictions(work, runs):
    """strata-tune's predicted step (tune-<dtype>.json, from this machine's profile) for each
    offloaded row the bench measured, beside the measured step: the cost model checked on the
    machine it was profiled on. The nvme row's candidate is the one at the row's aio setting."""
    out = {}
    for dtype in ("fp32", "bf16"):
        try:
            with open(os.path.join(work, f"tune-{dtype}.json"), encoding="utf-8") as f:
                cands = json.load(f).get("candidates", [])
        except (OSError, ValueError):
            continue
        for place in ("cpu", "nvme"):
            name = f"{place}-{dtype}"
            want = f"param={place} optimizer={place}"
            if place == "nvme":
                try:
                    with open(os.path.join(work, f"cfg-{name}.json"), encoding="utf-8") as f:
                        aio = json.load(f).get("aio", {})
                    want += (f" aio={aio['block_size'] / 2**20:.2f} MiBxQD{aio['queue_depth']}"
                             f"x{aio.get('intra_op_parallelism', 1)}")
                except (OSError, ValueError, KeyError):
                    continue
            match = [c for c in cands if c.get("placement") == want and c.get("planned", True)]
            if not match:
                continue
            entry = {"placement": want, "predicted_s": match[0]["predicted"]["step_s"],
                     "feasible": match[0].get("feasible")}
            measured = runs.get(name, {}).get("step_s")
            if measured:
                entry["measured_s"] = measured
                entry["measured_over_predicted"] = measured / entry["predicted_s"]
            out[name] = entry
    return out


def bench_json(a):
    """Everything the bench phase measured, from its work folder, as one object."""
    runs, peers = {}, {}
    for path in sorted(glob.glob(os.path.join(a.work, "train-*.jsonl"))):
        name = os.path.basename(path)[len("train-"):-len(".jsonl")]
        r = summarize_train(path)
        if not r.get("ok"):
            r["error"] = err_tail(os.path.join(a.work, f"train-{name}.err"))
        runs[name] = r
    for path in sorted(glob.glob(os.path.join(a.work, "peer-*.jsonl"))):
        name = os.path.basename(path)[len("peer-"):-len(".jsonl")]
        _, summary, _ = read_lines(path)
        if summary:
            summary["ok"] = True
            peers[name] = summary
        else:
            peers[name] = {"ok": False, "error": err_tail(os.path.join(a.work, f"peer-{name}.err"))}
    ratios = {}
    for dtype in ("fp32", "bf16"):
        ours, theirs = runs.get(f"cpu-{dtype}", {}), peers.get(f"fsdp2-cpu-{dtype}", {})
        if ours.get("step_s") and theirs.get("mean_step_s"):
            ratios[f"strata cpu / FSDP2 CPUOffload step ({dtype})"] = (
                ours["step_s"] / theirs["mean_step_s"])
    out = {"runs": runs, "peers": peers, "ratios": ratios,
           "ceilings": ceilings(os.path.join(a.work, "profile.json")),
           "predictions": tuner_predictions(a.work, runs)}
    out["ok"] = bool(runs) and all(r.get("ok") for r in runs.values())
    print(json.dumps(out))
    return 0


def train_summary(a):
    print(json.dumps(summarize_train(a.file, a.skip_first)))
    return 0


# --- the report -------------------------------------------------------------------------------
def fmt(v, unit="", digits=3):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}g}{unit}"
    return f"{v}{unit}"


def fmt_bytes(b):
    if not b:
        return "–"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b} B"


def report(a):
    phases = {}
    for path in sorted(glob.glob(os.path.join(a.outdir, "*.json"))):
        name = os.path.splitext(os.path.basename(path))[0]
        try:
            with open(path, encoding="utf-8") as f:
                phases[name] = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            phases[name] = {"ok": False, "error": f"unreadable: {e}"}
    phases.pop("report", None)
    lines = ["# Strata on a GPU machine: gpu-check report", ""]
    machine = next((p.get("machine") for p in phases.values() if p.get("machine")), None)
    if machine:
        lines += [f"Machine: {machine}", ""]
    lines += ["| phase | ok | seconds | notes |", "|---|---|---|---|"]
    for name in ("build", "test", "bench", "scale"):
        p = phases.get(name)
        if p is None:
            lines.append(f"| {name} | not run | – | |")
            continue
        lines.append(f"| {name} | {'yes' if p.get('ok') else 'NO'} | {fmt(p.get('seconds'))} | "
                     f"{p.get('notes', '')} |")
    t = phases.get("test")
    if t:
        lines += ["", "## test", "", "| suite | result |", "|---|---|"]
        for suite, result in t.get("suites", {}).items():
            lines.append(f"| {suite} | {result} |")
    b = phases.get("bench")
    if b:
        lines += ["", "## bench", ""]
        ceil = b.get("ceilings", {})
        if ceil:
            lines.append("Ceilings on this machine: " + ", ".join(
                f"{k} {fmt(v)}" for k, v in ceil.items() if v is not None) + ".")
            lines.append("")
        lines += ["| run | params | step s | compute | copy | nvme | optimizer | bound by | "
                  "overlap | peak device | peak host | loss |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in b.get("runs", {}).items():
            if not r.get("ok"):
                lines.append(f"| {name} | failed: {r.get('error', '?')} |||||||||||")
                continue
            lines.append(
                f"| {name} | {fmt(r.get('params'))} | {fmt(r.get('step_s'))} | "
                f"{fmt(r.get('compute_s'))} | {fmt(r.get('copy_s'))} | {fmt(r.get('nvme_s'))} | "
                f"{fmt(r.get('optimizer_s'))} | {r.get('bound_by') or '–'} | "
                f"{fmt(r.get('overlap'), digits=2)} | {fmt_bytes(r.get('peak_device_bytes'))} | "
                f"{fmt_bytes(r.get('peak_host_bytes'))} | {fmt(r.get('loss'), digits=6)} |")
        for name, r in b.get("peers", {}).items():
            if r.get("ok"):
                lines.append(f"| {name} | {fmt(r.get('params'))} | {fmt(r.get('mean_step_s'))} | "
                             f"||||||{fmt_bytes(r.get('peak_device_bytes'))} | "
                             f"{fmt_bytes(r.get('peak_rss_bytes'))} | {fmt(r.get('last_loss'), digits=6)} |")
            else:
                lines.append(f"| {name} | not run: {r.get('error', '?')} |||||||||||")
        for k, v in b.get("ratios", {}).items():
            lines.append(f"\n{k}: {fmt(v)}")
        preds = b.get("predictions", {})
        if preds:
            lines += ["", "strata-tune on this machine's profile, against the rows above:", "",
                      "| run | placement | predicted s | measured s | measured / predicted |",
                      "|---|---|---|---|---|"]
            for name, p in preds.items():
                lines.append(f"| {name} | {p['placement']} | {fmt(p['predicted_s'])} | "
                             f"{fmt(p.get('measured_s'))} | {fmt(p.get('measured_over_predicted'), digits=2)} |")
    s = phases.get("scale")
    if s:
        # peak device: the engine's own allocations; GPU in use: nvidia-smi's peak (every
        # allocator and the context) beside the reserve the plan kept for compute.
        lines += ["", "## scale", "", "| size | placement | params | step s | TFLOPS | bound by | "
                  "peak device | GPU in use | reserve | peak host | disk | result |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in s.get("runs", []):
            lines.append(
                f"| {r.get('size')} | {r.get('placement')} | {fmt(r.get('params'))} | "
                f"{fmt(r.get('step_s'))} | {fmt(r.get('tflops'))} | {r.get('bound_by') or '–'} | "
                f"{fmt_bytes(r.get('peak_device_bytes'))} | {fmt_bytes(r.get('gpu_mem_peak_bytes'))} | "
                f"{fmt_bytes(r.get('device_reserve'))} | {fmt_bytes(r.get('peak_host_bytes'))} | "
                f"{fmt_bytes(r.get('disk_bytes'))} | {r.get('result', '')} |")
        if s.get("largest"):
            lines.append(f"\nLargest trained: {s['largest']}.")
    print("\n".join(lines))
    return 0


def largest(a):
    """The largest size the scale phase trained, in words; nothing when none trained."""
    trained = [r for r in json.loads(a.runs) if r.get("result") == "trained"]
    if trained:
        b = max(trained, key=lambda r: r.get("params") or 0)
        n = b["params"]
        count = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
        print(f"{b['size']} ({count} params, {b['placement']} offload, {b['tflops']:.3g} TFLOPS)")
    return 0


def phase_json(a):
    """The phase's JSON: key=value pairs (a value that parses as JSON is taken as such), over
    the objects of any --merge files."""
    obj = {}
    for path in a.merge or []:
        try:
            with open(path, encoding="utf-8") as f:
                obj.update(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            obj.setdefault("merge_errors", []).append(f"{path}: {e}")
    for kv in a.pairs:
        key, _, value = kv.partition("=")
        try:
            obj[key] = json.loads(value)
        except json.JSONDecodeError:
            obj[key] = value
    text = json.dumps(obj, indent=1)
    for path in a.out:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("config", help="write a training config derived from BASE")
    c.add_argument("base")
    c.add_argument("out")
    c.add_argument("--placement", choices=["none", "cpu", "nvme", "auto"], required=True)
    c.add_argument("--device-reserve", help="strata.device_reserve (placement auto), in bytes")
    c.add_argument("--bf16-master", action="store_true", help="bf16.bf16_master_weights_and_grads")
    c.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    c.add_argument("--device", choices=["cuda", "cpu", "auto"], default="auto")
    c.add_argument("--nvme-path", default="/var/tmp/strata-gpu-nvme")
    c.add_argument("--host-budget")
    c.add_argument("--device-budget")
    c.add_argument("--state-dtype", choices=["fp32", "bf16", "int8"])
    c.add_argument("--chunk-size")
    c.add_argument("--model", help="layers,d_model,heads,seq_len")
    c.add_argument("--micro-batch", type=int)
    c.add_argument("--checkpoint-activations", action="store_true")
    c.set_defaults(fn=make_config)
    t = sub.add_parser("train-summary", help="summarize one strata-train --json output")
    t.add_argument("file")
    t.add_argument("--skip-first", type=int, default=1)
    t.set_defaults(fn=train_summary)
    bj = sub.add_parser("bench-json", help="the bench phase's runs and ceilings as one object")
    bj.add_argument("work")
    bj.set_defaults(fn=bench_json)
    r = sub.add_parser("report", help="markdown table from a gpu-check OUT folder")
    r.add_argument("outdir")
    r.set_defaults(fn=report)
    pj = sub.add_parser("phase-json", help="write a phase's JSON from key=value pairs")
    pj.add_argument("--out", action="append", required=True, help="file to write (repeatable)")
    pj.add_argument("--merge", action="append", help="a JSON object file to start from")
    pj.add_argument("pairs", nargs="*")
    pj.set_defaults(fn=phase_json)
    lg = sub.add_parser("largest", help="the largest trained size of a scale runs list (JSON)")
    lg.add_argument("runs")
    lg.set_defaults(fn=largest)
    sz = sub.add_parser("size", help="print layers,d_model,heads of a scale size")
    sz.add_argument("name", choices=sorted(SCALE_SIZES))
    sz.set_defaults(fn=lambda a: print(",".join(str(x) for x in SCALE_SIZES[a.name])) or 0)
    a = p.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
