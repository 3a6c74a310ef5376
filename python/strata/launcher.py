"""strata.launcher: the `deepspeed` command, DeepSpeed's launcher flags over strata-launch.

    deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json

starts 2 local ranks of `python3 train.py --local_rank=R --deepspeed ...`, each with RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, through strata-launch (which prefixes
output, forwards signals and ends every rank when one fails). One machine only: a flag that asks
for more (several nodes, a hostfile with other hosts, elastic training) is refused by name.
"""

import argparse
import os
import shutil
import socket
import sys
import sysconfig

DEEPSPEED_ENVIRONMENT_NAME = os.environ.get("DS_ENV_FILE", ".deepspeed_env")
_LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", socket.gethostname()}


class LaunchError(Exception):
    pass


def _parser():
    p = argparse.ArgumentParser(
        prog="deepspeed", allow_abbrev=False,
        description="Runs a DeepSpeed training script on this machine's ranks with Strata "
                    "(through strata-launch). DeepSpeed's launcher flags are accepted; those "
                    "that need several machines are refused by name.",
        epilog="Example: deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config "
               "ds.json. On a machine without GPUs, --num_gpus counts CPU ranks (default 1).")
    p.add_argument("-H", "--hostfile", default=None,
                   help="a hostfile; only this machine's entries may be used")
    p.add_argument("-i", "--include", default="",
                   help="ranks to use, as localhost:0,1 (GPUs, or CPU ranks)")
    p.add_argument("-e", "--exclude", default="", help="ranks to leave out, as localhost:1")
    p.add_argument("--num_nodes", type=int, default=-1, help="1 (one machine) or unset")
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1, dest="num_gpus",
                   help="ranks on this machine (default: every GPU, else 1)")
    p.add_argument("--master_port", type=int, default=None,
                   help="rank 0's port (default: a free one)")
    p.add_argument("--master_addr", default=None, help="must be this machine")
    p.add_argument("--node_rank", type=int, default=-1, help="0 or unset")
    p.add_argument("--launcher", default="pdsh", help="ignored on one machine")
    p.add_argument("--launcher_args", default="", help="ignored on one machine")
    p.add_argument("--module", action="store_true", help="run user_script as `python -m`")
    p.add_argument("--no_python", action="store_true", help="run user_script as a program")
    p.add_argument("--no_local_rank", action="store_true",
                   help="do not pass --local_rank to the script")
    p.add_argument("--no_ssh_check", action="store_true", help="ignored")
    p.add_argument("--bind_cores_to_rank", action="store_true",
                   help="pin each rank to its share of the cores (and set OMP_NUM_THREADS)")
    p.add_argument("--bind_core_list", default=None,
                   help="the cores to share out, as 0-7,16-23 (default: all)")
    # Accepted so that they can be refused by name (or ignored, where harmless on one machine).
    for flag in ("--force_multi", "--elastic_training", "--save_pid"):
        p.add_argument(flag, action="store_const", const=True, default=None, help=argparse.SUPPRESS)
    for flag in ("--autotuning", "--enable_each_rank_log", "--min_elastic_nodes",
                 "--max_elastic_nodes", "--ssh_port", "--comment", "--venv_script"):
        p.add_argument(flag, default=None, help=argparse.SUPPRESS)
    p.add_argument("user_script", help="the training script")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def _parse_slots(spec, flag):
    """'localhost:0,1@localhost:2' -> [0, 1, 2]; hosts other than this one are refused."""
    slots = []
    for part in spec.split("@"):
        host, _, ids = part.partition(":")
        if host not in _LOCAL_HOSTS:
            raise LaunchError(f"{flag} {spec}: host {host!r} is not this machine; the deepspeed "
                              "command of Strata starts ranks on one machine (see strata-launch "
                              "--help for several)")
        if ids or ":" in part:
            try:
                listed = [int(x) for x in ids.split(",")]
            except ValueError:
                listed = [-1]
            if any(x < 0 for x in listed) or len(set(listed)) != len(listed):
                raise LaunchError(f"{flag} {spec}: slots must be distinct integers >= 0, as "
                                  "localhost:0,1")
            slots.extend(listed)
    return slots


def _hostfile_slots(path):
    if path is None:
        return None
    if not os.path.exists(path):
        raise LaunchError(f"--hostfile {path}: no such file")
    if not os.path.isfile(path):
        raise LaunchError(f"--hostfile {path}: not a regular file; give a file of "
                          "'<host> slots=<n>' lines")
    hosts = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise LaunchError(f"--hostfile {path}: cannot be read as text ({e})") from None
    for number, line in enumerate(lines, 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        host, _, slots = line.partition(" ")
        slots = slots.strip()
        count = (slots[len("slots="):] if slots.startswith("slots=") else slots) or "1"
        if not count.isdigit() or not 1 <= int(count) <= 4096:
            raise LaunchError(f"--hostfile {path}, line {number} ({line!r}): each line is "
                              "'<host> slots=<n>' with n from 1 to 4096")
        hosts[host] = int(count)
    others = [h for h in hosts if h not in _LOCAL_HOSTS]
    if others:
        raise LaunchError(f"--hostfile {path} names other machines ({', '.join(others)}); "
                          "Strata's deepspeed command starts ranks on this machine only")
    if not hosts:
        raise LaunchError(f"--hostfile {path} lists no hosts; each line is '<host> slots=<n>', "
                          "as 'localhost slots=2' (DeepSpeed refuses an empty hostfile too)")
    return sum(hosts.values())


def _cores(spec):
    if spec is None:
        return sorted(os.sched_getaffinity(0))
    out = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        if not a.isdigit() or not (b or a).isdigit() or int(b or a) < int(a):
            raise LaunchError(f"--bind_core_list {spec}: cores are numbers and ranges, as 0-3,8")
        out.extend(range(int(a), int(b or a) + 1))
    return out


def _gpu_count():
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch or no driver: no GPUs
        return 0


def plan(args):
    """(nproc, environment additions) for the parsed flags; LaunchError for what cannot run."""
    for flag in ("force_multi", "elastic_training", "autotuning", "enable_each_rank_log",
                 "min_elastic_nodes", "max_elastic_nodes"):
        if getattr(args, flag) is not None:
            raise LaunchError(f"--{flag}: not supported by Strata's deepspeed command (one "
                              "machine, a fixed number of ranks)")
    if args.num_nodes not in (-1, 1):
        raise LaunchError(f"--num_nodes {args.num_nodes}: Strata's deepspeed command starts "
                          "ranks on one machine; for several, run strata-launch or torchrun on "
                          "each (strata-launch --help)")
    if args.node_rank not in (-1, 0):
        raise LaunchError(f"--node_rank {args.node_rank}: one machine only")
    if args.master_addr is not None and args.master_addr not in _LOCAL_HOSTS:
        raise LaunchError(f"--master_addr {args.master_addr}: must be this machine "
                          "(localhost); Strata's deepspeed command runs on one machine")
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise LaunchError(f"--master_port {args.master_port}: a TCP port from 1 to 65535")
    if args.module and args.no_python:
        raise LaunchError("--module and --no_python exclude each other")
    env = {}
    gpus = _gpu_count()
    from_hostfile = _hostfile_slots(args.hostfile)
    if gpus > 0:
        if args.num_gpus > gpus:
            raise LaunchError(f"--num_gpus {args.num_gpus}: this machine has {gpus} GPUs")
        available = list(range(gpus))
    else:  # CPU ranks: as many as asked for (or the hostfile's slots), else one
        available = list(range(args.num_gpus if args.num_gpus > 0 else from_hostfile or 1))
    if args.include:
        if args.exclude:
            raise LaunchError("--include and --exclude exclude each other")
        chosen = _parse_slots(args.include, "--include") or available
        if gpus > 0 and any(s >= gpus for s in chosen):
            raise LaunchError(f"--include {args.include}: this machine has {gpus} GPUs")
    else:
        dropped = set(_parse_slots(args.exclude, "--exclude")) if args.exclude else set()
        chosen = [s for s in available if s not in dropped]
        if gpus > 0 and args.num_gpus > 0:
            chosen = chosen[:args.num_gpus]
    if not chosen:
        raise LaunchError("no ranks left to start (check --include/--exclude)")
    if gpus > 0:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in chosen)
    nproc = len(chosen)
    if args.bind_cores_to_rank:
        cores = _cores(args.bind_core_list)
        per = len(cores) // nproc
        if per < 1:
            raise LaunchError(f"--bind_cores_to_rank: {len(cores)} cores for {nproc} ranks")
        env["STRATA_RANK_CORES"] = ";".join(
            ",".join(str(c) for c in cores[r * per:(r + 1) * per]) for r in range(nproc))
        env["OMP_NUM_THREADS"] = str(per)
    return nproc, env


def _env_file():
    """KEY=VALUE lines of .deepspeed_env (this directory, then the home directory), which
    DeepSpeed exports to every rank."""
    out = {}
    for d in (os.getcwd(), os.path.expanduser("~")):
        path = os.path.join(d, DEEPSPEED_ENVIRONMENT_NAME)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    key, sep, value = line.strip().partition("=")
                    if sep and key:
                        out[key] = value
            break
    return out


def _strata_launch():
    here = os.path.dirname(os.path.abspath(__file__))
    # <build>/python/strata -> <build>/bin/strata-launch, else the PATH's.
    # A pip install: the commands of this interpreter's environment (a venv's bin, found even
    # when the venv is not activated).
    for candidate in (os.path.join(os.path.dirname(os.path.dirname(here)), "bin", "strata-launch"),
                      os.path.join(sysconfig.get_path("scripts"), "strata-launch")):
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("strata-launch")
    if found is None:
        raise LaunchError("strata-launch not found next to the strata package, among "
                          f"{sys.executable}'s commands or on PATH: pip install the project "
                          "(pip install --no-build-isolation .), or source <build>/strata-env.sh")
    return found


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        nproc, env = plan(args)
        launch = _strata_launch()
    except LaunchError as e:
        print(f"deepspeed: {e}", file=sys.stderr)
        return 2
    env.update(_env_file())
    os.environ.update(env)
    rank_cmd = [sys.executable, "-m", "strata.launcher", "--rank-exec",
                "1" if args.no_local_rank else "0",
                "module" if args.module else "program" if args.no_python else "script",
                args.user_script] + args.user_args
    cmd = [launch, "--nproc", str(nproc)]
    if args.master_port is not None:
        cmd += ["--master-port", str(args.master_port)]
    cmd += ["--"] + rank_cmd
    sys.stdout.flush()
    os.execv(launch, cmd)


def rank_exec(no_local_rank, kind, script, user_args):
    """In each rank: pin the cores, then become `python script --local_rank=R args`."""
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    cores = os.environ.get("STRATA_RANK_CORES")
    if cores:
        os.sched_setaffinity(0, {int(c) for c in cores.split(";")[rank].split(",")})
    extra = [] if no_local_rank == "1" else [f"--local_rank={rank}"]
    if kind == "program":
        os.execvp(script, [script] + extra + user_args)
    head = [sys.executable, "-u"] + (["-m"] if kind == "module" else [])
    os.execv(sys.executable, head + [script] + extra + user_args)


if __name__ == "__main__":
    if len(sys.argv) >= 5 and sys.argv[1] == "--rank-exec":
        rank_exec(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
    sys.exit(main())
