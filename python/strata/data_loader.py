"""The training loader DeepSpeed builds for a script (initialize(training_data=...),
engine.deepspeed_io(dataset)): each rank's share of the data in micro-batches.

  - a DistributedSampler over the data-parallel ranks (seed 0, shuffled for training, in order
    for the eval and predict routes) under a launcher or with several ranks; a RandomSampler on
    the global RNG in a plain single process, as DeepSpeed without a local rank;
  - batches of train_micro_batch_size_per_gpu unless told otherwise; the last partial batch kept
    unless the config sets dataloader_drop_last;
  - loading in the calling process unless num_local_io_workers says otherwise (DeepSpeed starts
    two workers per device; most scripts' datasets are in memory, and workers fork the engine).
"""

import os

import torch

from ._strata import InvalidArgumentError

ROUTE_TRAIN, ROUTE_EVAL, ROUTE_PREDICT = "train", "eval", "predict"


def is_map_style_dataset(obj):
    return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")


def is_iterable_style_dataset(obj):
    return isinstance(obj, torch.utils.data.IterableDataset)


def make_loader(engine, dataset, batch_size=None, route=ROUTE_TRAIN, pin_memory=True,
                data_sampler=None, collate_fn=None, num_local_io_workers=None):
    if not (is_map_style_dataset(dataset) or is_iterable_style_dataset(dataset)):
        raise InvalidArgumentError(
            f"deepspeed_io: {type(dataset).__name__} is not a torch Dataset (a map-style one with "
            "__getitem__ and __len__, or an IterableDataset)")
    if route not in (ROUTE_TRAIN, ROUTE_EVAL, ROUTE_PREDICT):
        raise InvalidArgumentError(f"deepspeed_io(route={route!r}): one of 'train', 'eval', "
                                   "'predict'")
    if batch_size is None:
        batch_size = engine.train_micro_batch_size_per_gpu()
    if data_sampler is None and is_map_style_dataset(dataset):
        if engine.world_size > 1 or "LOCAL_RANK" in os.environ:
            # Over the data-parallel ranks: all of them, but a pipeline's groups (strata/pipe.py).
            data_sampler = torch.utils.data.distributed.DistributedSampler(
                dataset, num_replicas=engine.dp_world_size, rank=engine.get_data_parallel_rank(),
                shuffle=route == ROUTE_TRAIN)
        elif route == ROUTE_TRAIN:
            data_sampler = torch.utils.data.RandomSampler(dataset)
    return torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, sampler=data_sampler, collate_fn=collate_fn,
        drop_last=bool(engine.dataloader_drop_last()), num_workers=num_local_io_workers or 0,
        pin_memory=bool(pin_memory) and engine.device.type == "cuda")
