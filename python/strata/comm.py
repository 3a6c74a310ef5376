"""strata.comm: the process group a training script talks to (DeepSpeed's `deepspeed.comm`).

Strata's engine joins the ranks with its own communicator (runtime/comm: Gloo or NCCL from C++).
A script's own collectives (`torch.distributed.barrier()`, an all_reduce of a metric, a
DistributedSampler) need torch's default process group, which this module creates and wraps:

    strata.comm.init_distributed()          # torch.distributed, from RANK/WORLD_SIZE/MASTER_*
    strata.comm.all_reduce(t)               # torch.distributed.all_reduce on that group

Both communicators live side by side in one process (Note [two rendezvous]).

Without the rank variables (a plain `python train.py`), init_distributed makes a world of one
with an in-process store (no port), so that scripts that call torch.distributed
unconditionally still run.
Before any group exists, get_rank() is 0 and get_world_size() is 1 (DeepSpeed asserts instead;
answering for the one process there is lets single-process scripts and tests run).
"""

import datetime
import os
import socket

import torch
import torch.distributed as _dist

from ._strata import InvalidArgumentError

ReduceOp = _dist.ReduceOp

# Note [two rendezvous]
# torch's default group and the engine's communicator each rendezvous through a c10d TCPStore.
# torch's rank 0 serves its store on MASTER_PORT, so the engine cannot serve a second one there.
# Once torch's group exists, the engine's first rendezvous uses a port that rank 0 picks and
# sends to the others through torch's group (engine_rendezvous_port below).

_RANK_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port(host="127.0.0.1"):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def default_backend():
    """nccl where the engine computes on a GPU, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and _dist.is_nccl_available() else "gloo"


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500,
                     verbose=True, timeout=datetime.timedelta(minutes=30), init_method=None,
                     dist_init_required=None, config=None, rank=-1, world_size=-1):
    """Creates torch's default process group from the torchrun-style environment (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK: what `deepspeed`, `strata-launch` and
    torchrun set). Does nothing when the group exists. MPI discovery is not implemented: under
    mpirun, export those variables from OMPI_COMM_WORLD_* first."""
    if _dist.is_initialized():
        return
    if dist_init_required is False:
        return
    env = os.environ
    if rank >= 0:
        env["RANK"] = str(rank)
    if world_size > 0:
        env["WORLD_SIZE"] = str(world_size)
    missing = [v for v in _RANK_VARS if v not in env]
    if missing and init_method is None:
        if env.get("WORLD_SIZE", "1") == "1":
            # A single process started without a launcher: a world of one.
            env.setdefault("RANK", "0")
            env.setdefault("WORLD_SIZE", "1")
            env.setdefault("LOCAL_RANK", "0")
        else:
            raise InvalidArgumentError(
                f"init_distributed: {', '.join(missing)} not set; start the script with "
                "`deepspeed --num_gpus N script.py`, `strata-launch --nproc N -- python3 "
                "script.py` or torchrun, which set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
    backend = dist_backend or default_backend()
    if ":" in backend:
        # torch 2's per-device form, "cpu:gloo,cuda:nccl": the entry for the engine's device.
        per_device = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
        backend = per_device.get("cuda" if default_backend() == "nccl" else "cpu", backend)
    if backend not in ("gloo", "nccl"):
        raise InvalidArgumentError(
            f"init_distributed(dist_backend={backend!r}): Strata runs gloo (CPU device) or nccl "
            "(GPUs); pass one of those or None")
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if init_method is None and env.get("WORLD_SIZE") == "1":
        # A world of one needs no rendezvous: an in-process store, so that no port (the
        # environment's may be taken, or meant for someone else) is bound.
        _dist.init_process_group(backend=backend, store=_dist.HashStore(), rank=0, world_size=1,
                                 timeout=timeout)
        return
    try:
        _dist.init_process_group(backend=backend, init_method=init_method or "env://",
                                 timeout=timeout)
    except RuntimeError as e:
        # torch 2.x serves env://'s TCPStore through libuv by default; a torch built without it
        # (Debian's 2.6) refuses, on every rank alike, before anything is bound. Its other store
        # backend is there: every rank retries with it.
        if "libuv" not in str(e) or (init_method or "env://") != "env://":
            raise
        env["USE_LIBUV"] = "0"
        _dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)


def is_initialized():
    return _dist.is_initialized()


def is_available():
    return _dist.is_available()


def get_rank(group=None):
    return _dist.get_rank(group) if _dist.is_initialized() else 0


def get_world_size(group=None):
    return _dist.get_world_size(group) if _dist.is_initialized() else 1


def get_local_rank():
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_world_group():
    return _dist.group.WORLD


def get_backend(group=None):
    return _dist.get_backend(group)


def _need_group(what):
    if not _dist.is_initialized():
        if get_world_size() == 1:
            return False
        raise InvalidArgumentError(f"{what}: no process group; call init_distributed() first")
    return True


def barrier(group=None, async_op=False, device_ids=None):
    if _need_group("barrier"):
        return _dist.barrier(group=group, async_op=async_op)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """In place, as torch.distributed.all_reduce. Without a group (one process) the tensor
    already holds the result."""
    if _need_group("all_reduce"):
        return _dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False):
    if _need_group("reduce"):
        return _dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(tensor, src, group=None, async_op=False):
    if _need_group("broadcast"):
        return _dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    if _need_group("all_gather"):
        return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    tensor_list[0].copy_(tensor)


def all_gather_object(object_list, obj, group=None):
    if _need_group("all_gather_object"):
        return _dist.all_gather_object(object_list, obj, group=group)
    object_list[0] = obj


def broadcast_object_list(object_list, src=0, group=None, device=None):
    if _need_group("broadcast_object_list"):
        return _dist.broadcast_object_list(object_list, src=src, group=group)


def new_group(ranks=None, **kwargs):
    return _dist.new_group(ranks=ranks, **kwargs)


def destroy_process_group(group=None):
    """Ends torch's group (the engine's communicator is separate and lives until exit)."""
    if _dist.is_initialized():
        _dist.destroy_process_group(group)


def get_global_rank(group=None, group_rank=0):
    return _dist.distributed_c10d._get_global_rank(group, group_rank) if group else group_rank


def engine_rendezvous_port():
    """The MASTER_PORT the engine's communicator should use (Note [two rendezvous]): the
    environment's when torch's group does not exist or has one rank, else a port rank 0 picks."""
    if not _dist.is_initialized() or _dist.get_world_size() == 1:
        return None
    chosen = [_free_port("") if _dist.get_rank() == 0 else None]
    _dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


__all__ = ["ReduceOp", "init_distributed", "is_initialized", "is_available", "get_rank",
           "get_world_size", "get_local_rank", "get_world_group", "get_backend", "barrier",
           "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_object",
           "broadcast_object_list", "new_group", "destroy_process_group", "get_global_rank"]
