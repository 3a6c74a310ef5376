"""StrataEngine: the object strata.initialize returns, with DeepSpeed's engine API over the C++
engine (runtime/engine.h).

    loss = engine(batch)          # the model's own forward; unit hooks gather and release
    engine.backward(loss)         # backward, gradient reduction, optimizer chunks as they finish
    engine.step()                 # the optimizer step at each accumulation boundary

The engine owns the model's trainable parameters from initialize on: under stage 3 a unit's
parameters have no memory outside its forward and backward (use strata.zero.GatheredParameters
to read them), gradients never accumulate in .grad, and the optimizer states live in the
configured tiers.
"""

import base64
import io
import json
import os
import weakref

import torch

from . import units as _units
from ._strata import InvalidArgumentError, StrataError


class StrataEngine(torch.nn.Module):
    def __init__(self, cpp, model, units):
        super().__init__()
        self.module = model
        self._cpp = cpp
        self._units = units
        # The C++ engine numbers its units itself (a root holding parameters of its own is unit 0,
        # always gathered): the hooks and GatheredParameters use its numbers, found by name.
        by_name = {cpp.unit_name(i): i for i in range(cpp.num_units)}
        missing = [name for name, _ in units if name not in by_name]
        if missing:
            raise StrataError(f"the engine has no unit named {missing[0]!r} (a bug)")
        self._unit_index = [by_name[name] for name, _ in units]
        self._hooks = _units.UnitHooks(cpp, [(self._unit_index[i], m) for i, (_, m) in enumerate(units)])
        self._config = json.loads(cpp.config_json)
        # "cuda:0", not the device's display name ("cuda:0 (NVIDIA H100 ...)").
        self._device = torch.device(json.loads(cpp.describe())["torch_device"])
        self._stepped_at = 0  # micro-step count at the last optimizer step
        # id(parameter) -> the units holding it (root parameters: none, they stay gathered).
        self._param_units = {}
        for index, (_, module) in zip(self._unit_index, units):
            for p in module.parameters():
                self._param_units.setdefault(id(p), set()).add(index)
        self._model_params = {id(p) for p in model.parameters()}
        self.last_report = None  # the StepReport of the last step, as a dict
        _live_engines[id(self)] = self

    # --- forward ------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        outer = _units.thread_state.engine
        _units.thread_state.engine = self
        try:
            return self.module(*args, **kwargs)
        except BaseException:
            self._hooks.end_open_units()
            raise
        finally:
            _units.thread_state.engine = outer

    # --- backward and step --------------------------------------------------------------------
    def backward(self, loss, retain_graph=False):
        """Backward of `loss` (divided by gradient_accumulation_steps, scaled for fp16) and the
        reduction of its gradients into each rank's shard."""
        if retain_graph:
            raise InvalidArgumentError("engine.backward(retain_graph=True): Strata releases each "
                                       "unit after its backward; run forward again instead")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise InvalidArgumentError("engine.backward(loss) needs a scalar loss tensor")
        self._cpp.backward(loss)
        return loss

    def is_gradient_accumulation_boundary(self):
        return self._cpp.micro_step % self.gradient_accumulation_steps() == 0

    def step(self, lr_kwargs=None):
        """Applies the optimizer once gradient_accumulation_steps micro-batches have run through
        backward; before that it does nothing (as DeepSpeed's engine.step)."""
        micro = self._cpp.micro_step
        if micro == self._stepped_at or not self.is_gradient_accumulation_boundary():
            return
        self.last_report = json.loads(self._cpp.step())
        self._stepped_at = micro

    def zero_grad(self, set_to_none=True):
        """Nothing to clear: the engine moves gradients out of .grad as they are computed."""

    # --- what DeepSpeed scripts read ----------------------------------------------------------
    @property
    def global_steps(self):
        return self._cpp.global_step

    @property
    def global_samples(self):
        return self.global_steps * self.train_batch_size()

    @property
    def global_rank(self):
        return self._cpp.rank

    @property
    def local_rank(self):
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def world_size(self):
        return self._cpp.world_size

    @property
    def device(self):
        """The engine's device: where inputs and the gathered parameters live."""
        return self._device

    def train_micro_batch_size_per_gpu(self):
        return self._config["train_micro_batch_size_per_gpu"]

    def gradient_accumulation_steps(self):
        return self._config["gradient_accumulation_steps"]

    def train_batch_size(self):
        return (self.train_micro_batch_size_per_gpu() * self.gradient_accumulation_steps() *
                self.world_size)

    def zero_optimization_stage(self):
        return self._config["zero_optimization"]["stage"]

    def get_lr(self):
        """The learning rate the next optimizer step uses, as a one-element list."""
        return [self._cpp.lr_at(self.global_steps + 1)]

    @property
    def config(self):
        """The effective config: every default filled in, "auto" values resolved."""
        return self._config

    def describe(self):
        """Placement, chunking and sizes (JSON), for logs."""
        return json.loads(self._cpp.describe())

    def unit_names(self):
        return [name for name, _ in self._units]

    # --- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True):
        """Saves every rank's partitions, the optimizer and schedule state, module buffers and
        `client_state` (anything torch.save can write) atomically: a crash while saving leaves the
        previous checkpoint loadable. Collective: every rank calls it. Without a tag the
        checkpoint is save_dir/step-<N>; with one, save_dir/<tag>."""
        save_dir = os.fspath(save_dir)
        root = os.path.join(save_dir, str(tag)) if tag is not None else save_dir
        buf = io.BytesIO()
        torch.save(client_state if client_state is not None else {}, buf)
        extra = {"client_state": base64.b64encode(buf.getvalue()).decode("ascii"),
                 "tag": None if tag is None else str(tag)}
        self._cpp.save_checkpoint(root, json.dumps(extra))
        if tag is not None and save_latest and self.global_rank == 0:
            _write_atomic(os.path.join(save_dir, "latest"), str(tag))
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False):
        """Loads what save_checkpoint wrote (the latest one, or `tag`'s) and returns
        (path, client_state), or (None, None) when load_dir holds no checkpoint."""
        if not load_optimizer_states or load_module_only or not load_lr_scheduler_states:
            raise InvalidArgumentError(
                "load_checkpoint: Strata restores the whole training state (parameters, optimizer "
                "states, schedule); partial loads are not supported")
        load_dir = os.fspath(load_dir)
        root = os.path.join(load_dir, str(tag)) if tag is not None else load_dir
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if not os.path.exists(latest):
                return None, None
            with open(latest, encoding="utf-8") as f:
                name = f.read().strip()
            if os.path.exists(os.path.join(load_dir, name, "latest")):
                root = os.path.join(load_dir, name)  # a tagged save
        elif not os.path.isdir(root):
            raise InvalidArgumentError(f"load_checkpoint: no checkpoint tagged '{tag}' in {load_dir}")
        extra = json.loads(self._cpp.load_checkpoint(root))
        state = extra.get("client_state")
        client_state = None
        if state is not None:
            # The checkpoint's own pickle, written by save_checkpoint: any object torch.save takes.
            client_state = torch.load(io.BytesIO(base64.b64decode(state)), weights_only=False)
        self._stepped_at = self._cpp.micro_step
        return root, client_state

    # --- teardown -----------------------------------------------------------------------------
    def close(self):
        """Frees the engine's memory, NVMe files and threads now and removes its hooks. The model
        keeps no trained values afterwards: save a checkpoint first."""
        self._hooks.remove()
        self._cpp.close()
        _live_engines.pop(id(self), None)

    def _units_of_param(self, param):
        """The units holding `param` (empty for a root parameter), or None when the model has no
        such parameter."""
        if id(param) not in self._model_params:
            return None
        return self._param_units.get(id(param), set())

    def master_parameters(self):
        """The fp32 master value of every trainable parameter, in the model's named_parameters
        order (shared parameters once). Collective: every rank calls it."""
        return self._cpp.master_params()


# Engines alive in this process, for strata.zero.GatheredParameters; an engine nobody holds any
# more leaves by itself.
_live_engines = weakref.WeakValueDictionary()


def _write_atomic(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


__all__ = ["StrataEngine", "StrataError"]
