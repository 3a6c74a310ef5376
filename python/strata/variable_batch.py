"""Batches of variable size by a token budget, and an lr scaled to each batch's size: the API of
DeepSpeed's `deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr`, driven by
the config's `data_efficiency.data_sampling.dynamic_batching` section.

Sequences are taken in an order (as the loader yields them, shortest first, or shuffled by the
config's seed) and packed into micro-batches whose summed lengths stay within `max_tokens` and
whose sequence counts stay within [min_batch_size, max_batch_size]; `effective_batch_size`
consecutive micro-batches form one batch, and the lr of each step is the base lr scaled by that
batch's sequence count over the configured batch size ("linear", "sqrt" or none). Micro-batches are
dealt to the data-parallel ranks in turn, as a DistributedSampler without shuffling does.

Where Strata differs on purpose: the sequence lengths, when not given, are measured in memory with
the caller's `batch_seqlens_fn` at each call; nothing is written to the config's `metrics_path`
(DeepSpeed runs its DataAnalyzer and caches the result there). Pipeline engines do not exist in
Strata, so micro-batches of one batch never need equal sizes.
"""

import logging
import math
import random

import torch
from torch.utils.data import DataLoader, DistributedSampler

from ._strata import InvalidArgumentError

try:  # torch >= 2.0
    from torch.optim.lr_scheduler import LRScheduler as _SchedulerBase
except ImportError:  # torch 1.13
    from torch.optim.lr_scheduler import _LRScheduler as _SchedulerBase

logger = logging.getLogger("strata")


def batch_by_seqlens(seqlens, max_tokens, sequence_ids_per_mb=None, min_batch_size=1,
                     max_batch_size=None, sequence_picking_order="dataloader",
                     effective_batch_size=1, required_microbatches_of_same_size=False,
                     verbose=False, seed=None):
    """Packs sequences into micro-batches. Returns (microbatch_ids, batch_sizes,
    batch_max_seqlens): per micro-batch (batch index, sample indices); per batch its number of
    sequences and its longest sequence."""
    if sequence_picking_order not in ("random", "seqlen", "dataloader"):
        raise InvalidArgumentError(f"sequence_picking_order={sequence_picking_order!r}: must be "
                                   "'dataloader', 'seqlen' or 'random'")
    ids = list(range(len(seqlens))) if sequence_ids_per_mb is None else list(sequence_ids_per_mb)
    items = [(int(seqlens[i]), i) for i in ids]
    if sequence_picking_order == "random":
        random.Random(seed).shuffle(items)
    elif sequence_picking_order == "seqlen":
        items.sort()
    too_long = [i for n, i in items if n > max_tokens]
    if too_long:
        logger.warning(f"variable batches: samples {too_long} are longer than max_tokens="
                       f"{max_tokens} and are left out")
        items = [(n, i) for n, i in items if n <= max_tokens]

    def fits(mb):
        if min_batch_size and len(mb) < min_batch_size:
            return False
        if max_batch_size and len(mb) > max_batch_size:
            return False
        return sum(n for n, _ in mb) <= max_tokens

    # The longest run from `start` whose interleaved split into `k` micro-batches all fit; a run
    # that cannot start ends the packing (what is left cannot form a valid micro-batch).
    k = effective_batch_size if required_microbatches_of_same_size else 1
    micro = []
    start = 0
    while start < len(items):
        end = start
        for cand in range(start + k, len(items), k):
            run = items[start:cand]
            if all(fits(run[j::k]) for j in range(k)):
                end = cand
        if end == start:
            break
        run = items[start:end]
        micro += [run[j::k] for j in range(k)]
        start = end
    if len(micro) < effective_batch_size:
        raise InvalidArgumentError(
            f"variable batches: the data packs into {len(micro)} micro-batches, fewer than one "
            f"batch of {effective_batch_size}; lower max_tokens' packing limits or add data")
    micro = micro[:len(micro) - len(micro) % effective_batch_size]

    microbatch_ids, batch_sizes, batch_max_seqlens = [], [], []
    for b, first in enumerate(range(0, len(micro), effective_batch_size)):
        group = micro[first:first + effective_batch_size]
        batch_sizes.append(sum(len(mb) for mb in group))
        batch_max_seqlens.append(max(n for mb in group for n, _ in mb))
        microbatch_ids += [(b, [i for _, i in mb]) for mb in group]
        if verbose:
            logger.info(f"batch {b}: {len(group)} micro-batches, {batch_sizes[-1]} sequences, "
                        f"tokens per micro-batch {[sum(n for n, _ in mb) for mb in group]}")
    return microbatch_ids, batch_sizes, batch_max_seqlens


def scale_lr(base_batch_size, batch_size, base_lr=1, method="linear"):
    """The lr for `batch_size` given `base_lr` at `base_batch_size`: linear (Goyal et al.), sqrt
    (Krizhevsky), or unchanged for None / "none"."""
    if method == "linear":
        return base_lr * batch_size / base_batch_size
    if method == "sqrt":
        return base_lr * math.sqrt(batch_size / base_batch_size)
    if method is None or str(method).lower() == "none":
        return base_lr
    raise InvalidArgumentError(f"lr_scaling_method={method!r}: must be 'linear', 'sqrt' or None")


def dataloader_for_variable_batch_size(dataset, microbatch_ids, batch_max_seqlens,
                                       dataloader_rank=0, dataloader_batch_size=1,
                                       dataloader_num_replicas=1, dataloader_collate_fn=None,
                                       dataloader_num_workers=0, dataloader_pin_memory=False,
                                       required_microbatches_of_same_seqlen=False,
                                       sample_padding_fn=None):
    """A DataLoader over the micro-batches dealt to this rank; each item is the collated samples of
    `dataloader_batch_size` micro-batches. Returns (loader, the keyword arguments of it)."""
    if required_microbatches_of_same_seqlen and sample_padding_fn is None:
        raise InvalidArgumentError("variable batches: required_microbatches_of_same_seqlen needs "
                                   "sample_padding_fn")
    sampler = DistributedSampler(microbatch_ids, num_replicas=dataloader_num_replicas,
                                 rank=dataloader_rank, shuffle=False, drop_last=False)

    def collate(picked):
        samples = []
        for batch_id, ids in picked:
            rows = [dataset[i] for i in ids]
            if required_microbatches_of_same_seqlen:
                rows = [sample_padding_fn(r, batch_max_seqlens[batch_id]) for r in rows]
            samples += rows
        return dataloader_collate_fn(samples) if dataloader_collate_fn else samples

    kwargs = dict(dataset=microbatch_ids, batch_size=dataloader_batch_size,
                  pin_memory=dataloader_pin_memory, data_sampler=sampler, collate_fn=collate,
                  num_local_io_workers=dataloader_num_workers)
    loader = DataLoader(microbatch_ids, batch_size=dataloader_batch_size, sampler=sampler,
                        num_workers=dataloader_num_workers, collate_fn=collate,
                        pin_memory=dataloader_pin_memory)
    return loader, kwargs


class _ConstantLR(_SchedulerBase):
    """Keeps each group's lr as it was: the base when the engine has no scheduler."""

    def get_lr(self):
        return list(self.base_lrs)


class VariableBatchSizeLR(_SchedulerBase):
    """Wraps a scheduler and scales the lr it sets by the size of the batch about to run.
    step(0) rewinds to the first batch (call it at the start of each pass over the loader);
    step() after each optimizer step moves to the next."""

    def __init__(self, lr_scheduler, base_batch_size, batch_sizes, dataloader,
                 lr_scaling_method="linear", last_epoch=-1, verbose=False):
        self.base_lr_scheduler = lr_scheduler
        self.base_batch_size = base_batch_size
        self.batch_sizes = list(batch_sizes)
        self.dataloader = dataloader
        self.lr_scaling_method = lr_scaling_method
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.last_epoch = last_epoch
        self.verbose = verbose
        self.step(0)

    @property
    def optimizer(self):
        return self.base_lr_scheduler.optimizer

    def get_last_lr(self):
        return list(self._unscaled)

    def get_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]

    def step(self, epoch=None):
        groups = self.optimizer.param_groups
        # The wrapped scheduler steps from unscaled values: the base ones when rewinding.
        restore = self.base_lrs if epoch == 0 else getattr(self, "_unscaled", self.base_lrs)
        for g, lr in zip(groups, restore):
            g["lr"] = lr
        if epoch == 0:
            # Rewinding: the wrapped scheduler goes back to its first value, as DeepSpeed's call
            # with epoch 0 does.
            self.base_lr_scheduler.last_epoch = -1
            self.base_lr_scheduler.step()
        else:
            self.base_lr_scheduler.step()
        self._unscaled = [g["lr"] for g in groups]
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        size = self.batch_sizes[self.last_epoch % len(self.batch_sizes)]
        for g in groups:
            g["lr"] = scale_lr(self.base_batch_size, size, g["lr"], self.lr_scaling_method)
        if self.verbose:
            logger.info(f"batch {self.last_epoch}: {size} sequences (reference "
                        f"{self.base_batch_size}), lr {self.get_lr()}")

    def state_dict(self):
        return {"base_lr_scheduler": self.base_lr_scheduler.state_dict(),
                "base_batch_size": self.base_batch_size,
                "lr_scaling_method": self.lr_scaling_method, "batch_sizes": self.batch_sizes,
                "base_lrs": self.base_lrs, "last_epoch": self.last_epoch,
                "verbose": self.verbose}

    def load_state_dict(self, state_dict):
        self.base_lr_scheduler.load_state_dict(state_dict["base_lr_scheduler"])
        for key in ("base_batch_size", "lr_scaling_method", "batch_sizes", "base_lrs",
                    "last_epoch", "verbose"):
            setattr(self, key, state_dict[key])


def lr_scheduler_for_variable_batch_size(base_batch_size, batch_sizes, dataloader,
                                         lr_scheduler_or_optimizer, lr_scaling_method="linear",
                                         verbose=False):
    """VariableBatchSizeLR over a scheduler, or over an optimizer's constant lr."""
    if isinstance(lr_scheduler_or_optimizer, torch.optim.Optimizer):
        base = _ConstantLR(lr_scheduler_or_optimizer)
    elif isinstance(getattr(lr_scheduler_or_optimizer, "optimizer", None), torch.optim.Optimizer):
        base = lr_scheduler_or_optimizer
    else:
        raise InvalidArgumentError(
            f"variable batches: lr_scheduler_or_optimizer={type(lr_scheduler_or_optimizer).__name__}"
            " is neither a torch optimizer nor a scheduler with an .optimizer")
    return VariableBatchSizeLR(base, base_batch_size, batch_sizes, dataloader,
                               lr_scaling_method=lr_scaling_method, verbose=verbose)


def get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset, dataset_seqlens, max_tokens, effective_batch_size, dataset_filter_ids=None,
        lr_scaling_method="linear", min_batch_size=1, max_batch_size=None,
        sequence_picking_order="dataloader", dataloader_batch_size=1, dataloader_rank=0,
        dataloader_num_replicas=1, dataloader_num_workers=0, dataloader_collate_fn=None,
        dataloader_pin_memory=False, lr_scheduler_or_optimizer=None,
        required_microbatches_of_same_size=False, required_microbatches_of_same_seqlen=False,
        sample_padding_fn=None, verbose=False, seed=None):
    """(loader, scheduler, the loader's keyword arguments) for variable batches."""
    microbatch_ids, batch_sizes, batch_max_seqlens = batch_by_seqlens(
        dataset_seqlens, max_tokens, sequence_ids_per_mb=dataset_filter_ids,
        min_batch_size=min_batch_size, max_batch_size=max_batch_size,
        sequence_picking_order=sequence_picking_order, effective_batch_size=effective_batch_size,
        required_microbatches_of_same_size=required_microbatches_of_same_size, verbose=verbose,
        seed=seed)
    loader, kwargs = dataloader_for_variable_batch_size(
        dataset, microbatch_ids, batch_max_seqlens, dataloader_rank=dataloader_rank,
        dataloader_batch_size=dataloader_batch_size,
        dataloader_num_replicas=dataloader_num_replicas,
        dataloader_collate_fn=dataloader_collate_fn, dataloader_num_workers=dataloader_num_workers,
        dataloader_pin_memory=dataloader_pin_memory,
        required_microbatches_of_same_seqlen=required_microbatches_of_same_seqlen,
        sample_padding_fn=sample_padding_fn)
    sched = None
    if lr_scheduler_or_optimizer is not None:
        sched = lr_scheduler_for_variable_batch_size(effective_batch_size, batch_sizes, loader,
                                                     lr_scheduler_or_optimizer,
                                                     lr_scaling_method=lr_scaling_method,
                                                     verbose=verbose)
    return loader, sched, kwargs


def _measure_seqlens(dataset, batch_seqlens_fn, collate_fn):
    """Every sample's length by the caller's function, over collated batches of 1024."""
    if batch_seqlens_fn is None:
        raise InvalidArgumentError("variable batches: pass dataset_seqlens, or batch_seqlens_fn to "
                                   "measure them")
    lengths = []
    for first in range(0, len(dataset), 1024):
        rows = [dataset[i] for i in range(first, min(len(dataset), first + 1024))]
        got = batch_seqlens_fn(collate_fn(rows) if collate_fn else rows)
        lengths += [int(n) for n in (got.tolist() if hasattr(got, "tolist") else got)]
    if len(lengths) != len(dataset):
        raise InvalidArgumentError(f"variable batches: batch_seqlens_fn gave {len(lengths)} "
                                   f"lengths for {len(dataset)} samples")
    return lengths


def get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset, engine, dataset_seqlens=None, dataset_filter_ids=None, dataloader_collate_fn=None,
        sample_padding_fn=None, batch_seqlens_fn=None):
    """The same, configured from the engine's config (data_efficiency.data_sampling) and sizes."""
    # The section as the script wrote it (the engine's effective config keeps only what it uses).
    efficiency = (getattr(engine, "_user_config", None) or {}).get("data_efficiency")
    sampling = (efficiency or {}).get("data_sampling", {})
    batching = sampling.get("dynamic_batching", {})
    if not batching.get("enabled", False):
        raise InvalidArgumentError("variable batches: data_efficiency.data_sampling."
                                   "dynamic_batching.enabled is not true in the config")
    if "max_tokens" not in batching:
        raise InvalidArgumentError("variable batches: data_efficiency.data_sampling."
                                   "dynamic_batching.max_tokens is required")
    if dataset_seqlens is None:
        dataset_seqlens = _measure_seqlens(dataset, batch_seqlens_fn, dataloader_collate_fn)
    group = engine.data_parallel_group
    return get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset=dataset, dataset_filter_ids=dataset_filter_ids, dataset_seqlens=dataset_seqlens,
        effective_batch_size=engine.train_batch_size(), max_tokens=batching["max_tokens"],
        lr_scaling_method=batching.get("lr_scaling_method", "linear"),
        sequence_picking_order=batching.get("sequence_picking_order", "dataloader"),
        min_batch_size=batching.get("min_batch_size", 1),
        max_batch_size=batching.get("max_batch_size"),
        dataloader_batch_size=engine.train_micro_batch_size_per_gpu(),
        dataloader_rank=group.rank(), dataloader_num_replicas=group.size(),
        dataloader_num_workers=sampling.get("num_workers", 0),
        dataloader_collate_fn=dataloader_collate_fn,
        dataloader_pin_memory=sampling.get("pin_memory", False),
        sample_padding_fn=sample_padding_fn,
        lr_scheduler_or_optimizer=engine.lr_scheduler or engine.optimizer,
        verbose=batching.get("verbose", False), seed=(efficiency or {}).get("seed"))
