"""The engine initialize returns for a PipelineModule (Note [pipelines on one rank] in
strata/pipe.py): DeepSpeed's train_batch / eval_batch over Strata's engine."""

import warnings

import torch

from ._strata import InvalidArgumentError
from .engine import StrataEngine
from .pipe import PipelineModule
from .runtime_utils import RepeatingLoader


def engine_config(cfg, model, world):
    """The config the engine runs for `model` over `world` ranks: under a PipelineModule the
    ranks of one pipeline group repeat each other's micro-batches, so a train_batch_size given in
    DeepSpeed's terms (micro x accumulation x dp) is scaled to the ranks that compute it; and
    the "pipeline" section is the PipelineEngine's (configure_pipeline), not the engine's."""
    if not isinstance(model, PipelineModule):
        return cfg
    out = dict(cfg)
    out.pop("pipeline", None)
    if "train_batch_size" in cfg:
        out["train_batch_size"] = int(cfg["train_batch_size"]) * (world // model.dp_world_size)
    return out


class PipelineEngine(StrataEngine):
    """DeepSpeed's PipelineEngine over a PipelineModule (Note [pipelines on one rank]):
    train_batch and eval_batch drive the micro-batches; forward, backward and step alone are
    refused, as DeepSpeed refuses them in pipeline mode."""

    _micro_batch_per_backward = True  # train_batch's own loop (Note [one backward])

    def __init__(self, cpp, model, units):
        super().__init__(cpp, model, units)
        self.pipeline_parallelism = True
        self.num_stages = model.num_stages
        self.stage_id = model.stage_id
        self._dp = model.dp_world_size
        self.is_pipe_parallel = model.num_stages > 1
        self.is_data_parallel = self._dp > 1
        self.micro_batches = self.gradient_accumulation_steps()
        self.data_iterator = None
        self.batch_fn = None
        self.agg_train_loss = None
        self.total_loss = None
        if model.num_stages > 1:
            warnings.warn(
                f"deepspeed.pipe: Strata runs all {model.num_stages} stages of this "
                f"PipelineModule on each rank; the {model.num_stages} ranks of each pipeline "
                "group compute the same micro-batches, so results are DeepSpeed's but the model "
                "is not split across them (ZeRO stage 3 with offload spreads a model that does "
                "not fit)")

    def configure_pipeline(self, section):
        """The config's "pipeline" section, as DeepSpeed's engine reads it: a positive
        activation_checkpoint_interval replaces the module's. use_reentrant false asks DeepSpeed
        for its non-reentrant checkpoint; Strata's checkpoint function serves both (the same
        results), with a warning. The partitioning keys (stages, partition, pipe_partitioned,
        grad_partitioned) have nothing to act on: every stage runs here."""
        section = dict(section or {})
        interval = section.get("activation_checkpoint_interval", 0)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
            raise InvalidArgumentError(f"pipeline.activation_checkpoint_interval={interval!r}: a "
                                       "whole number of layers, 0 for none")
        if interval > 0:
            self.module.activation_checkpoint_interval = interval
        if section.get("use_reentrant") is False:
            warnings.warn("pipeline.use_reentrant=false: Strata checkpoints activations with its "
                          "own function, reentrant; the results are the same")

    # --- DeepSpeed's data-parallel view: dp groups, not ranks --------------------------------
    @property
    def dp_world_size(self):
        return self._dp

    @property
    def seq_dp_world_size(self):
        return self._dp

    def get_data_parallel_rank(self):
        return self.global_rank % self._dp

    def get_pipeline_parallel_rank(self):
        return self.stage_id

    def is_first_stage(self):
        return self.stage_id == 0

    def is_last_stage(self):
        return self.stage_id == self.num_stages - 1

    # --- data ----------------------------------------------------------------------------------
    def _loader_for(self, training_data, collate_fn):
        """As DeepSpeed's pipeline engine: the data in order (no shuffle) over the dp groups,
        repeating; that loader is what initialize returns and what train_batch reads."""
        if training_data is None:
            return None
        self.training_data, self.collate_fn = training_data, collate_fn
        loader = training_data
        if not isinstance(training_data, torch.utils.data.IterableDataset):
            sampler = torch.utils.data.distributed.DistributedSampler(
                training_data, num_replicas=self.dp_world_size,
                rank=self.get_data_parallel_rank(), shuffle=False)
            loader = self.deepspeed_io(training_data, data_sampler=sampler)
        else:
            loader = self.deepspeed_io(training_data)
        self.set_dataloader(RepeatingLoader(loader))
        return self.training_dataloader

    def set_dataloader(self, loader):
        self.training_dataloader = loader
        self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator):
        self.data_iterator = iterator

    def set_batch_fn(self, fn):
        self.batch_fn = fn

    def reset_activation_shape(self):
        """Activations do not travel between ranks here: nothing to reset."""

    def set_has_attention_mask(self, value):
        self.has_attention_mask = bool(value)

    def _next_micro_batch(self):
        if self.data_iterator is None:
            raise InvalidArgumentError(
                "train_batch/eval_batch: no data; pass data_iter, or training_data to "
                "deepspeed.initialize")
        batch = next(self.data_iterator)
        if self.batch_fn is not None:
            batch = self.batch_fn(batch)
        if not isinstance(batch, (tuple, list)) or len(batch) < 2:
            raise InvalidArgumentError(
                "a pipeline micro-batch is (inputs, labels), as DeepSpeed's PipelineEngine reads "
                f"it; got a {type(batch).__name__}")
        # As DeepSpeed: with reentrant activation checkpointing the inputs' floating tensors
        # require grad, or the first checkpointed segment would be cut off from autograd.
        grads = self.module.activation_checkpoint_interval > 0 and \
            getattr(self.module.activation_checkpoint_func, "__name__", "") != "non_reentrant_checkpoint"
        return self._to_device(batch[0], grads), self._to_device(batch[1])

    def _to_device(self, value, requires_grad=False):
        if isinstance(value, torch.Tensor):
            value = value.to(self.device)
            if requires_grad and value.is_floating_point():
                value = value.detach().clone().requires_grad_(True)
            return value
        if isinstance(value, (tuple, list)):
            return type(value)(self._to_device(v, requires_grad) for v in value)
        return value

    def _mean_over_dp(self, value):
        """The mean over the dp groups: over every rank, as a group's ranks hold equal values."""
        if self.world_size > 1 and torch.distributed.is_initialized():
            value = value.clone()
            torch.distributed.all_reduce(value)
            value /= self.world_size
        return value

    # --- the schedule --------------------------------------------------------------------------
    def train_batch(self, data_iter=None):
        """gradient_accumulation_steps micro-batches through forward, loss_fn and backward, then
        the optimizer step; returns their mean loss (averaged over the dp groups)."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() "
                               "instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        total = None
        for _ in range(self.micro_batches):
            inputs, labels = self._next_micro_batch()
            outputs = StrataEngine.forward(self, inputs)
            loss = self.module.loss_fn(outputs, labels) if self.module.loss_fn is not None \
                else outputs
            StrataEngine.backward(self, loss)
            total = loss.detach().float() if total is None else total + loss.detach().float()
        StrataEngine.step(self)
        self.total_loss = total
        self.agg_train_loss = self._mean_over_dp(total / self.micro_batches)
        every = self.steps_per_print()
        if isinstance(every, int) and every > 0 and self.global_steps % every == 0 and \
                self.global_rank == 0:
            print(f"steps: {self.global_steps} loss: {self.agg_train_loss.item():0.4f}")
        return self.agg_train_loss

    def eval_batch(self, data_iter, return_logits=False, compute_loss=True, reduce_output="avg",
                   bcast_loss=True, num_micro_batches=None):
        """The model in eval mode over num_micro_batches (default gradient_accumulation_steps)
        micro-batches without gradients; returns the mean loss (reduce_output='avg', over the
        micro-batches and the dp groups) or the list of each micro-batch's (None), and with
        return_logits the last micro-batch's outputs too."""
        if reduce_output not in ("avg", None):
            raise InvalidArgumentError(f"eval_batch(reduce_output={reduce_output!r}): 'avg' or "
                                       "None")
        training_iterator = self.data_iterator
        self.set_dataiterator(data_iter)
        self.module.eval()
        results, outputs = [], None
        try:
            with torch.no_grad():
                for _ in range(num_micro_batches or self.micro_batches):
                    inputs, labels = self._next_micro_batch()
                    outputs = StrataEngine.forward(self, inputs)
                    results.append(self.module.loss_fn(outputs, labels)
                                   if compute_loss and self.module.loss_fn is not None
                                   else outputs)
        finally:
            self.set_dataiterator(training_iterator)
        if reduce_output == "avg":
            if all(isinstance(r, torch.Tensor) for r in results):
                result = self._mean_over_dp(sum(r.float() for r in results) / len(results))
            else:
                result = [self._mean_over_dp(sum(r[i].float() for r in results) / len(results))
                          for i in range(len(results[0]))]
        else:
            result = results
        return (result, outputs) if return_logits else result

    def forward(self, *args, **kwargs):
        raise _only_train_batch("forward")

    def backward(self, *args, **kwargs):
        raise _only_train_batch("backward")

    def step(self, *args, **kwargs):
        raise _only_train_batch("step")


def _only_train_batch(name):
    return InvalidArgumentError(f"engine.{name}(): Only train_batch() is accessible in pipeline "
                                "mode (DeepSpeed's rule): call engine.train_batch(data_iter), or "
                                "engine.eval_batch(data_iter) to evaluate")
