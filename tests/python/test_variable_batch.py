"""Variable batch size and lr (deepspeed.runtime.data_pipeline's API, strata.variable_batch):
the packing keeps every micro-batch within the token budget and the size limits, batches are
whole groups of micro-batches dealt to the ranks in turn, the lr follows each batch's size by the
linear and sqrt rules, and training through the engine on that loader and scheduler equals plain
PyTorch on the same loader and scheduler."""

import copy
import math
import random

import pytest
import torch

import strata
from strata import InvalidArgumentError
from strata.variable_batch import (batch_by_seqlens,
                                   get_dataloader_and_lr_scheduler_for_variable_batch_size,
                                   get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed,
                                   scale_lr)


class Sequences(torch.utils.data.Dataset):
    """Sequences of 3..11 tokens of width 4 (padding 0), labelled with their length."""

    def __init__(self, n=120, seed=3):
        rng = random.Random(seed)
        self.seqs = [torch.full((rng.randrange(3, 12), 4), 0.5) + 0.01 * i for i in range(n)]

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return self.seqs[i], float(len(self.seqs[i]))

    @staticmethod
    def collate(rows):
        seqs, labels = zip(*rows)
        return (torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True),
                torch.tensor(labels, dtype=torch.float32))

    @staticmethod
    def lengths(batch):
        seqs, _ = batch
        return torch.tensor([int((s[:, 0] != 0).sum()) for s in seqs])


class Pooled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 16)
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.inner(x))).mean(dim=(1, 2)) * 8


@pytest.mark.parametrize("order", ["dataloader", "seqlen", "random"])
def test_packing_respects_the_budget_and_the_sizes(order):
    # Any two fit the budget, so packing never stalls on a pair it cannot start (where DeepSpeed's
    # rule, kept here, ends the packing).
    rng = random.Random(1)
    seqlens = [rng.randrange(1, 20) for _ in range(300)] + [50]  # one longer than the budget
    ids, sizes, longest = batch_by_seqlens(seqlens, max_tokens=40, min_batch_size=2,
                                           max_batch_size=6, sequence_picking_order=order,
                                           effective_batch_size=4, seed=7)
    assert len(ids) % 4 == 0 and len(sizes) == len(ids) // 4 == len(longest)
    seen = []
    for k, (batch, mb) in enumerate(ids):
        assert batch == k // 4
        assert 2 <= len(mb) <= 6 and sum(seqlens[i] for i in mb) <= 40
        seen += mb
    assert len(seen) == len(set(seen)) and 300 not in seen  # no repeats; the long one left out
    for b in range(len(sizes)):
        group = [mb for batch, mb in ids if batch == b]
        assert sizes[b] == sum(len(mb) for mb in group)
        assert longest[b] == max(seqlens[i] for mb in group for i in mb)
    if order == "seqlen":
        flat = [seqlens[i] for _, mb in ids for i in mb]
        assert flat == sorted(flat)


def test_the_lr_follows_each_batchs_size():
    assert scale_lr(16, 32, 1e-3, "linear") == pytest.approx(2e-3)
    assert scale_lr(16, 64, 1e-3, "sqrt") == pytest.approx(2e-3)
    assert scale_lr(16, 64, 1e-3, None) == 1e-3
    with pytest.raises(InvalidArgumentError, match="lr_scaling_method"):
        scale_lr(16, 64, 1e-3, "cube")
    data = Sequences()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seqlens = [len(s) for s in data.seqs]
    loader, sched, _ = get_dataloader_and_lr_scheduler_for_variable_batch_size(
        data, seqlens, max_tokens=24, effective_batch_size=4, lr_scaling_method="sqrt",
        dataloader_collate_fn=Sequences.collate, lr_scheduler_or_optimizer=opt)
    sizes = sched.batch_sizes
    for step in range(len(sizes) + 2):  # past the end it wraps around
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * math.sqrt(sizes[step % len(sizes)] / 4))
        sched.step()
    sched.step(0)  # rewinds to the first batch
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * math.sqrt(sizes[0] / 4))


def _train(loader, sched, step_fn, batches):
    losses = []
    it = iter(loader)
    for _ in range(batches):
        x, y = next(it)
        losses.append(step_fn(x, y))
    return losses


def test_the_engine_trains_as_plain_pytorch_on_variable_batches():
    data = Sequences()
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.002, "momentum": 0.9}},
              "zero_optimization": {"stage": 2},
              "data_efficiency": {"enabled": True, "seed": 5, "data_sampling": {
                  "num_workers": 0, "dynamic_batching": {
                      "enabled": True, "max_tokens": 20, "lr_scaling_method": "linear",
                      "sequence_picking_order": "random", "min_batch_size": 1,
                      "max_batch_size": 4}}}}
    torch.manual_seed(0)
    model = Pooled()
    reference = copy.deepcopy(model)
    engine, _, _, _ = strata.initialize(model=model, config=copy.deepcopy(config))
    loader, sched, _ = get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        data, engine, dataloader_collate_fn=Sequences.collate, batch_seqlens_fn=Sequences.lengths)
    engine.lr_scheduler = sched  # as DeepSpeed's example does: the engine steps it
    lrs = []

    def engine_step(x, y):
        lrs.append(engine.optimizer.param_groups[0]["lr"])
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    batches = min(12, len(loader))
    got = _train(loader, sched, engine_step, batches)
    engine.close()

    # Plain PyTorch on the same loader and the same kind of scheduler over torch's SGD.
    opt = torch.optim.SGD(reference.parameters(), lr=0.002, momentum=0.9)
    seqlens = [len(s) for s in data.seqs]
    ref_loader, ref_sched, _ = get_dataloader_and_lr_scheduler_for_variable_batch_size(
        data, seqlens, max_tokens=20, effective_batch_size=2, lr_scaling_method="linear",
        sequence_picking_order="random", min_batch_size=1, max_batch_size=4,
        dataloader_batch_size=2, dataloader_collate_fn=Sequences.collate,
        lr_scheduler_or_optimizer=opt, seed=5)
    ref_lrs = []

    def torch_step(x, y):
        ref_lrs.append(opt.param_groups[0]["lr"])
        loss = torch.nn.functional.mse_loss(reference(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_sched.step()
        return loss.item()

    want = _train(ref_loader, ref_sched, torch_step, batches)
    assert lrs == pytest.approx(ref_lrs, rel=1e-12)
    assert len(set(lrs)) > 1  # the batches really differ in size
    assert all(math.isfinite(v) for v in got)
    assert got == pytest.approx(want, rel=1e-5)


def test_a_config_without_dynamic_batching_is_named():
    torch.manual_seed(0)
    engine, _, _, _ = strata.initialize(model=Pooled(), config={
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    with pytest.raises(InvalidArgumentError, match="dynamic_batching.enabled"):
        get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(Sequences(), engine)
    engine.close()
