"""StrataEngine: the object strata.initialize returns, with DeepSpeed's engine API over the C++
engine (runtime/engine/engine.h).

    loss = engine(batch)          # the model's own forward; unit hooks gather and release
    engine.backward(loss)         # backward, gradient reduction, optimizer chunks as they finish
    engine.step()                 # the optimizer step at each accumulation boundary

The engine owns the model's trainable parameters from initialize on: under stage 3 a unit's
parameters have no memory (and 0 elements) outside its forward and backward (use
strata.zero.GatheredParameters to read them), gradients never accumulate in .grad, and the
optimizer states live in the configured tiers.
"""

import base64
import io
import itertools
import json
import os
import weakref
import zlib
from collections.abc import Mapping

import torch

from . import data_loader as _data
from . import engine_surface as _surface
from . import param_state as _param_state
from . import _strata
from . import units as _units
from ._strata import InvalidArgumentError, StrataError
from .engine_config_view import ConfigView

# _replaced_by of an engine that close() (or destroy()) ended.
_CLOSED = "it was closed"


class StrataEngine(ConfigView, torch.nn.Module):
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
        hooked = [(self._unit_index[i], m) for i, (_, m) in enumerate(units)]
        if "" in by_name:
            # The root's own parameters (unit ""): gathered for the engine's life, but its forward
            # is a unit's all the same, so that a model whose parameters all belong to the root
            # (nn.Linear, a parameters-only module) opens its micro-step and is reached in
            # backward like any other. Its hooks run outside its children's.
            hooked.insert(0, (by_name[""], model))
        self._hooks = _units.UnitHooks(cpp, hooked)
        self._config = json.loads(cpp.config_json)
        # "cuda:0", not the device's display name ("cuda:0 (NVIDIA H100 ...)").
        self._device = torch.device(json.loads(cpp.describe())["torch_device"])
        self._stepped_at = 0  # micro-step count at the last optimizer step
        # The micro-step count at the last call of step() (Note [one backward]).
        self._step_called_at = 0
        self._boundary_override = None  # set_gradient_accumulation_boundary's value
        self._replaced_by = None  # why this engine no longer trains (destroy, a later initialize)
        self.optimizer = None  # set by initialize: the optimizer and scheduler it returned
        # Where the lr of each step is read (Note [the lr from Python]): the groups of
        # `optimizer`, or of the torch optimizer a client scheduler steps. Set by initialize.
        self._lr_source = None
        self._client_scheduler = False  # lr_scheduler is the script's, stepped here
        self._client_optimizer = None  # the torch optimizer given to initialize, if any
        # Note [a client optimizer]: per group, the tensors the client optimizer steps (None
        # when the engine runs its own optimizer).
        self._client_params = None
        self._lr_scheduler = None
        self._lr_pushed = None  # the lr last handed to the C++ engine
        # id(parameter) -> the units holding it (root parameters: none, they stay gathered).
        self._param_units = {}
        for index, (_, module) in zip(self._unit_index, units):
            for p in module.parameters():
                self._param_units.setdefault(id(p), set()).add(index)
        self._model_params = {id(p) for p in model.parameters()}
        # What the engine trains, in master_parameters()'s order: requires_grad as initialize
        # found it (a layer frozen later is still the engine's, and destroy gives it back).
        self._trained = [p for _, p in model.named_parameters() if p.requires_grad]
        for p in model.parameters():
            # The engine holds rank 0's values on every rank now: no longer zero.Init's scratch.
            p.__dict__.pop("_strata_rank0_values", None)
        self.last_report = None  # the last step's _strata.StepReport (attributes, or a mapping)
        # DeepSpeed's plain attributes (python/ENGINE_SURFACE.md); initialize sets the first ones.
        self.client_lr_scheduler = None
        self.training_data = None
        self.collate_fn = None
        self.training_dataloader = None
        self.mpu = None
        self.pipeline_parallelism = False
        self.has_moe_layers = False
        self.dont_change_device = False
        self.gradient_average = True
        self.param_names = {p: name for name, p in model.named_parameters()}
        _live_engines[id(self)] = self

    def __getattr__(self, name):
        """As DeepSpeed's engine: a name the engine does not have is the model's. DeepSpeed's
        names Strata does not implement raise NotSupportedError saying why (never a bare
        AttributeError); python/ENGINE_SURFACE.md lists them all."""
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules (nn.Module)
        except AttributeError:
            pass
        if name in _surface.REFUSED_NAMES:
            raise _surface.refusal(name)
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None and not name.startswith("__"):
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(f"neither the engine nor the model ({type(module).__name__}) has "
                             f"{name!r}; python/ENGINE_SURFACE.md lists the engine's names")

    # --- forward ------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self._replaced_by is not None:
            self._check_forward_after_end()
        self._check_states_resident("forward")
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
    def backward(self, loss, allreduce_gradients=True, release_loss=False, retain_graph=False,
                 scale_wrt_gas=True):
        """Backward of `loss` (divided by gradient_accumulation_steps, scaled for fp16) and the
        reduction of its gradients into each rank's shard. scale_wrt_gas=False: the caller has
        divided the loss already (Hugging Face's Trainer does), so the engine does not."""
        self._check_live()
        if not allreduce_gradients:
            raise InvalidArgumentError("engine.backward(allreduce_gradients=False): Strata "
                                       "reduces every gradient into its shard during backward")
        if retain_graph:
            raise InvalidArgumentError("engine.backward(retain_graph=True): Strata releases each "
                                       "unit after its backward; run forward again instead")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise InvalidArgumentError("engine.backward(loss) needs a scalar loss tensor")
        self._check_one_backward()
        self._sync_lr()  # updates may start during this backward
        if not scale_wrt_gas:
            # The engine divides by the accumulation steps; undo it for a pre-divided loss.
            gas = self.gradient_accumulation_steps()
            self._cpp.backward(loss * gas if gas != 1 else loss)
        else:
            self._cpp.backward(loss)
        return loss

    # Note [one backward]
    # DeepSpeed ends a micro-batch in step(): a second backward before it adds its gradients to
    # the same micro-batch. Strata's engine counts micro-batches by backward, so with
    # gradient_accumulation_steps > 1 that second backward would count as the next micro-batch
    # and the step would come early, on part of the batch. It is refused, naming both ways out.
    # (With one micro-batch per step the engine refuses it itself. A caller that declares the
    # boundaries (set_gradient_accumulation_boundary, as accelerate does) steps only at them,
    # one backward per micro-batch, and the pipeline engine's train_batch runs one backward per
    # micro-batch by construction.)
    _micro_batch_per_backward = False

    def _check_one_backward(self):
        gas = self.gradient_accumulation_steps()
        micro = self._cpp.micro_step
        if gas > 1 and not self._micro_batch_per_backward and self._boundary_override is None \
                and micro > self._step_called_at and micro % gas != 0:
            raise InvalidArgumentError(
                "engine.backward(): a second backward in one micro-batch (no engine.step() "
                f"since the last backward; gradient_accumulation_steps={gas}). Strata counts "
                "each backward as a micro-batch, where DeepSpeed would add both into one: add "
                "the losses and call backward once, or call engine.step() after each backward")

    def is_gradient_accumulation_boundary(self):
        if self._boundary_override is not None:
            return self._boundary_override
        return self._cpp.micro_step % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary):
        """Overrides the boundary test, as accelerate does before each backward. The engine
        steps only where the micro-step count is a multiple of gradient_accumulation_steps, so a
        boundary declared elsewhere is refused at step() with the counts."""
        self._boundary_override = bool(is_boundary)

    def step(self, lr_kwargs=None):
        """Applies the optimizer once gradient_accumulation_steps micro-batches have run through
        backward; before that it does nothing (as DeepSpeed's engine.step). A client LR scheduler
        given to initialize steps after each optimizer step."""
        self._check_live()
        self._check_states_resident("step()")
        micro = self._cpp.micro_step
        self._step_called_at = micro
        if micro == self._stepped_at and any(p.grad is not None for p in self.module.parameters()
                                             if p.requires_grad):
            # The engine moves every gradient out of .grad inside engine.backward: one left
            # there came from a backward it never saw. (Under stage 3 that backward itself fails.)
            raise InvalidArgumentError(
                "engine.step(): the model's parameters hold gradients from loss.backward(), "
                "which the engine does not see; call engine.backward(loss) instead, which "
                "reduces the gradients into the optimizer's shards")
        if micro == self._stepped_at or not self.is_gradient_accumulation_boundary():
            return
        gas = self.gradient_accumulation_steps()
        if micro % gas != 0:
            raise InvalidArgumentError(
                f"engine.step(): the accumulation boundary was set after {micro % gas} of "
                f"{gas} micro-batches; Strata steps every gradient_accumulation_steps ({gas}) "
                "micro-batches: make the loop's accumulation match the config's")
        self._sync_lr()
        if self._client_params is not None:
            self.last_report = self._client_step()
        else:
            self.last_report = self._cpp.step()
        self._stepped_at = micro
        if self.last_report.skipped:
            return  # as DeepSpeed: an fp16 overflow does not advance the schedule
        # The engine stepped, not the wrapper a torch scheduler puts on optimizer.step: mark the
        # step on every optimizer a scheduler may watch (ours, the client's, the scheduler's),
        # as the wrapper would, or torch warns that the scheduler stepped first.
        # (A client optimizer that stepped itself has marked its own step.)
        stepped_itself = self._client_optimizer if self._client_params is not None else None
        for opt in {id(o): o for o in (self.optimizer, self._lr_source, self._client_optimizer,
                                       getattr(self.lr_scheduler, "optimizer", None))
                    if isinstance(o, torch.optim.Optimizer) and o is not stepped_itself}.values():
            opt._step_count = getattr(opt, "_step_count", 0) + 1
            opt._opt_called = True
        if self._client_scheduler:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self._publish_lr()

    # Note [a client optimizer]
    # An optimizer outside Strata's own set (zero_allow_untested_optimizer, or any optimizer at
    # stage 0, as DeepSpeed) runs itself, on the device, over this rank's partition: as DeepSpeed's
    # ZeRO-1/2 optimizer does, the client's param_groups get flat tensors in place of the model's
    # parameters, here one per run of the group's elements in a chunk's shard. At each boundary the
    # C++ engine reduces the gradients, takes the global norm, unscales and clips them, and lends
    # the fp32 master and gradient shards; they become those tensors' data and .grad, the client's
    # step() updates the master in place, and the engine takes the new values to the working copy
    # and the other ranks. The client's state (its moments, buffers) is its own: torch tensors on
    # the device, saved per rank beside the checkpoint's shards.
    def _attach_client_optimizer(self, optimizer):
        segments = self._cpp.client_segments()
        if len(segments) != len(optimizer.param_groups):
            raise StrataError(f"the engine has {len(segments)} parameter groups but the optimizer "
                              f"{len(optimizer.param_groups)} (a bug)")
        self._client_params = []
        for group, sizes in zip(optimizer.param_groups, segments):
            flat = [torch.nn.Parameter(torch.empty(0, device=self._device)) for _ in sizes]
            group["params"] = flat
            self._client_params.append(flat)
        optimizer.state.clear()  # whatever it held belonged to the model's own tensors

    def _client_step(self):
        skipped, lent = self._cpp.begin_client_step()
        if skipped:
            return self._cpp.finish_client_step()
        try:
            for params, pairs in zip(self._client_params, lent):
                for p, (master, grad) in zip(params, pairs):
                    p.data = master
                    p.grad = grad
            self._client_optimizer.step()
        except BaseException:
            # The engine takes nothing from a failed update; the master keeps what the
            # optimizer wrote (load a checkpoint to go on from a known state).
            self._cpp.finish_client_step(apply=False)
            raise
        finally:
            empty = torch.empty(0, device=self._device)
            for params in self._client_params:
                for p in params:  # the lent memory is the engine's again
                    p.grad = None
                    p.data = empty
        return self._cpp.finish_client_step()

    # Note [the lr from Python]
    # The lr of a step is whatever the optimizer's param_groups hold when its updates start, as
    # with torch.optim and DeepSpeed: a client scheduler stepped at each boundary, the Trainer's
    # LambdaLR on its own torch optimizer (whose groups StrataOptimizer shares), or a loop that
    # writes group["lr"] itself. The config's schedule takes part the way DeepSpeed's schedulers
    # do: after each step it writes the next step's lr into the groups (_publish_lr). Each group
    # keeps its own hyperparameters (betas, eps and weight_decay may move too: a OneCycleLR
    # cycles betas); the engine was built with the groups initialize saw, and no others.
    def _lr_groups(self):
        source = self._lr_source if self._lr_source is not None else self.optimizer
        return source.param_groups if source is not None else []

    def _sync_lr(self):
        """Hands every group's hyperparameters to the C++ engine when they changed."""
        groups = self._lr_groups()
        if not groups:
            return
        if len(groups) != self._cpp.num_param_groups:
            raise InvalidArgumentError(
                f"the optimizer has {len(groups)} parameter groups but the engine was built "
                f"with {self._cpp.num_param_groups}: groups cannot be added after initialize; "
                "pass every group to initialize (optimizer= or model_parameters=[{...}, ...])")
        from .config import group_hyperparameters
        defaults = self._config.get("optimizer", {}).get("params", {})
        values = [group_hyperparameters(g, defaults) for g in groups]
        if values != self._lr_pushed:
            try:
                self._cpp.set_groups(values)
            except InvalidArgumentError:
                # betas[0] past 1 from the config's OneCycle decay: the refusal names the schedule
                if self.lr_scheduler is not None and not self._client_scheduler:
                    self._cpp.check_scheduled_betas(self.global_steps + 1)
                raise
            self._lr_pushed = values

    def _publish_lr(self):
        """After a step: the config's schedule writes the next step's lr into the groups, and a
        client scheduler's own optimizer (when it is not ours) lends its lr to ours."""
        if self.optimizer is None:
            return
        if self._client_scheduler:
            if self._lr_source is not None and self._lr_source is not self.optimizer:
                lr = self._lr_source.param_groups[0]["lr"]
                for g in self.optimizer.param_groups:
                    g["lr"] = lr
        elif self.lr_scheduler is not None:
            self._write_config_schedule()

    def _write_config_schedule(self):
        """The config's schedule for the next step into every group: its lr, and OneCycle's
        betas under cycle_momentum."""
        step = self.global_steps + 1
        betas = self._cpp.betas_at(step)
        # Each group's lr from its own before the schedule wrote any (WarmupCosineLR scales it;
        # the other schedules give every group theirs).
        base_lrs = getattr(self, "_schedule_base_lrs", None)
        if base_lrs is None or len(base_lrs) != len(self.optimizer.param_groups):
            base_lrs = [None] * len(self.optimizer.param_groups)
        lrs = [self._cpp.lr_at(step) if b is None else self._cpp.group_lr_at(step, b)
               for b in base_lrs]
        for g, group_lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = group_lr
            if betas is not None:
                g["betas"] = tuple(betas)

    def zero_grad(self, set_to_none=True):
        """Nothing to clear: the engine moves gradients out of .grad as they are computed."""

    def get_global_grad_norm(self):
        """The global L2 norm of the gradients of the last optimizer step, before clipping (what
        torch.nn.utils.clip_grad_norm_ returns); None before the first step or after an fp16
        overflow; NaN when a non-finite gradient was applied (fp32/bf16 without clipping, where
        each update runs as its gradient arrives)."""
        if self.last_report is None or self.last_report.skipped:
            return None
        return self.last_report.grad_norm

    def was_step_applied(self):
        """False when the last step was skipped (fp16 overflow) or none ran yet."""
        return self.last_report is not None and not self.last_report.skipped

    @property
    def skipped_steps(self):
        return self._cpp.micro_step // self.gradient_accumulation_steps() - self.global_steps

    # --- what DeepSpeed scripts read ----------------------------------------------------------
    @property
    def lr_scheduler(self):
        """The scheduler stepped at each accumulation boundary: the config's schedule, the one
        given to initialize, or one a script assigns later (DeepSpeed steps whatever this holds;
        its variable-batch example assigns its VariableBatchSizeLR here)."""
        return self._lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, sched):
        from .optimizer import ConfigSchedule
        self._lr_scheduler = sched
        self._client_scheduler = sched is not None and not isinstance(sched, ConfigSchedule)
        self._lr_source = self.optimizer
        stepped = getattr(sched, "optimizer", None) if self._client_scheduler else None
        if isinstance(stepped, torch.optim.Optimizer) and stepped is not self._client_optimizer \
                and stepped is not self.optimizer:
            # A scheduler on a torch optimizer initialize never saw: its groups carry the lr.
            self._lr_source = stepped

    @property
    def data_parallel_group(self):
        """The ranks that split the batch (all of them: Strata is data-parallel only), as a
        process group with rank() and size()."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.group.WORLD
        return _SingleGroup()

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

    @property
    def micro_steps(self):
        """Micro-batches through backward so far."""
        return self._cpp.micro_step

    @property
    def dp_world_size(self):
        return self.world_size  # Strata is data-parallel only: every rank splits the batch

    @property
    def seq_dp_world_size(self):
        return self.world_size

    mp_world_size = 1
    sequence_parallel_size = 1

    @property
    def seq_data_parallel_group(self):
        return self.data_parallel_group

    @property
    def client_optimizer(self):
        return self._client_optimizer

    @property
    def basic_optimizer(self):
        return self._client_optimizer if self._client_optimizer is not None else self.optimizer

    def get_data_parallel_rank(self):
        return self.global_rank

    def get_model_parallel_rank(self):
        return 0

    def get_tensor_parallel_rank(self):
        return 0

    @property
    def is_compiled(self):
        return False

    def empty_partition_cache(self):
        """Stage 3 keeps no gathered parameters between forwards; what is left to free is the
        device allocator's cache."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # --- data ----------------------------------------------------------------------------------
    is_map_style_dataset = staticmethod(_data.is_map_style_dataset)
    is_iterable_style_dataset = staticmethod(_data.is_iterable_style_dataset)

    def deepspeed_io(self, dataset, batch_size=None, route=_data.ROUTE_TRAIN, pin_memory=True,
                     data_sampler=None, collate_fn=None, num_local_io_workers=None):
        """A DataLoader over this rank's share of `dataset` (strata/data_loader.py)."""
        return _data.make_loader(self, dataset, batch_size, route, pin_memory, data_sampler,
                                 collate_fn if collate_fn is not None else self.collate_fn,
                                 num_local_io_workers)

    def _loader_for(self, training_data, collate_fn):
        """initialize's loader: kept as training_dataloader, with its data and collate_fn."""
        if training_data is None:
            return None
        self.training_data, self.collate_fn = training_data, collate_fn
        self.training_dataloader = self.deepspeed_io(training_data, collate_fn=collate_fn)
        return self.training_dataloader

    def get_lr(self):
        """The learning rate the next optimizer step uses, as a one-element list."""
        groups = self._lr_groups()
        if groups:
            return [g["lr"] for g in groups]
        return [self._cpp.lr_at(self.global_steps + 1)]

    def _group_values(self, key):
        return [g.get(key, 0.0) for g in self._lr_groups() or []]

    def get_mom(self):
        """Per parameter group: momentum for SGD and RMSprop, betas for the others."""
        if self.optimizer_name() in ("SGD", "sgd", "RMSprop", "rmsprop"):
            return self._group_values("momentum")
        return self._group_values("betas")

    def get_type(self):
        return self._group_values("type")

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
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        """Saves every rank's partitions, the optimizer and schedule state, module buffers, the
        frozen parameters (rank 0, once; not with exclude_frozen_parameters=True) and
        `client_state` (anything torch.save can write) atomically: a crash while saving leaves the
        previous checkpoint loadable. Collective: every rank calls it. The checkpoint goes to
        save_dir/<tag>, the tag defaulting to DeepSpeed's global_step<N>, and save_dir/latest
        names it (save_latest=False leaves `latest` as it was)."""
        self._check_live()
        save_dir = os.fspath(save_dir)
        if tag is None:
            tag = f"global_step{self.global_steps}"
        prepared = None
        try:
            root = os.path.join(save_dir, _checked_tag("save_checkpoint", tag))
            extra, client_file = self._saved_state(client_state, tag)
        except Exception as e:  # noqa: BLE001 - every rank learns of it, then it is raised
            prepared = e
        self._agree_on_save(prepared, "prepare its state (its error says why)", tag)
        self._cpp.save_checkpoint(root, json.dumps(extra), client_file,
                                  with_frozen=not exclude_frozen_parameters)
        named = None
        if save_latest and self.global_rank == 0:
            try:
                _strata.write_file_atomic(os.path.join(save_dir, "latest"), str(tag).encode())
            except Exception as e:  # noqa: BLE001
                named = e
        self._agree_on_save(named, f"name tag {tag!r} in {os.path.join(save_dir, 'latest')} "
                            "(the tag's folder is saved whole)")
        if self.global_rank == 0:
            _drop_older_steps(root, f"step-{self.global_steps:08d}")
        return True

    def _saved_state(self, client_state, tag):
        """save_checkpoint's Python half: the manifest's extra (client_state with the optimizer's
        and schedule's state, pickled) and this rank's client-optimizer file."""
        state = dict(client_state) if client_state is not None else {}
        if self.lr_scheduler is not None and hasattr(self.lr_scheduler, "state_dict"):
            state[_SCHEDULER_KEY] = self.lr_scheduler.state_dict()
        if self.optimizer is not None:
            # The groups' hyperparameters: the lr of the next step lives there (a LambdaLR's
            # load_state_dict restores its counter but writes no lr until its next step).
            state[_OPTIMIZER_KEY] = self.optimizer.state_dict()
            if self._lr_source is not None and self._lr_source is not self.optimizer:
                state[_LR_SOURCE_KEY] = [dict((k, v) for k, v in g.items() if k != "params")
                                         for g in self._lr_source.param_groups]
        buf = io.BytesIO()
        torch.save(state, buf)
        extra = {"client_state": base64.b64encode(buf.getvalue()).decode("ascii"),
                 "tag": str(tag), "module_keys": self._module_keys()}
        client_file = b""
        if self._client_params is not None:
            # This rank's share of the client optimizer's state, beside its shards.
            opt_buf = io.BytesIO()
            torch.save(self._client_optimizer.state_dict(), opt_buf)
            client_file = opt_buf.getvalue()
        return extra, client_file

    # Note [a save agreed by every rank]
    # save_checkpoint is collective, and a rank that leaves it alone leaves the others waiting in
    # the engine's save until the communicator's timeout: client_state that one rank cannot
    # pickle, a tag that differs by rank (which would split one checkpoint over folders none of
    # which is whole), or rank 0 failing to write save_dir/latest after the others returned True.
    # Each phase is agreed through the engine's communicator, so every rank raises when any
    # fails. The engine's own save agrees on its phases itself.
    def _agree_on_save(self, error, what, tag=None):
        """Raises on every rank when `error` is set on any (its own error there, elsewhere one
        naming that rank and `what` it could not do); with `tag`, also when the ranks' tags
        differ."""
        if self.world_size > 1:
            values = [self.global_rank + 1.0 if error is not None else 0.0]
            if tag is not None:
                crc = float(zlib.crc32(str(tag).encode("utf-8")))
                values += [crc, -crc]
            got = self._cpp.all_reduce_scalars(values, "max")
            if error is None and got[0] > 0:
                raise StrataError(f"save_checkpoint: rank {int(got[0]) - 1} could not {what}")
            if error is None and tag is not None and got[1] != -got[2]:
                raise InvalidArgumentError(
                    f"save_checkpoint(tag={tag!r}): the ranks gave different tags; every rank "
                    "saves into one tag's folder, so give them all the same tag (a tag made from "
                    "the rank would leave a part of the checkpoint in each folder)")
        if error is not None:
            raise error

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False, custom_load_fn=None):
        """Loads what save_checkpoint wrote (save_dir/latest's tag, or `tag`) and returns
        (path, client_state), or (None, None) when load_dir holds no checkpoint.

        load_module_only=True: only the weights are restored (every rank's fp32 master and
        working copy, buffers and frozen parameters) and client_state is returned; the
        optimizer states, step counters and schedule keep their current values.
        load_optimizer_states=False: the weights, the step counters and (with
        load_lr_scheduler_states) the schedule; the optimizer keeps its states and goes on
        counting its own steps in their bias corrections, as DeepSpeed's does.

        client_state is unpickled: a checkpoint is trusted input (README, "Checkpoints"). It is
        read with torch's weights-only unpickler when its content allows, so a checkpoint of
        tensors, numbers, strings and containers runs no code."""
        self._check_live()
        if custom_load_fn is not None:
            raise InvalidArgumentError("load_checkpoint(custom_load_fn=...): not supported; "
                                       "load the weights with load_module_only=True")
        root = _resolve_checkpoint(os.fspath(load_dir), tag)
        if root is None:
            return None, None
        parts = "weights" if load_module_only else \
            "all" if load_optimizer_states else "weights_and_counters"
        extra = json.loads(self._cpp.load_checkpoint(root, parts=parts))
        state = extra.get("client_state")
        client_state = _unpickle_trusted(base64.b64decode(state)) if state is not None else None
        groups = source = sched = None
        if isinstance(client_state, dict):
            groups = client_state.pop(_OPTIMIZER_KEY, None)
            source = client_state.pop(_LR_SOURCE_KEY, None)
            sched = client_state.pop(_SCHEDULER_KEY, None)
        if load_module_only:
            return root, client_state
        self._stepped_at = self._step_called_at = self._cpp.micro_step
        if load_optimizer_states:
            if self._client_params is not None:
                self._load_client_optimizer(root)
            if groups is not None and self.optimizer is not None:
                self.optimizer.load_state_dict(groups)
            if source is not None and self._lr_source is not None and \
                    len(source) == len(self._lr_source.param_groups):
                for mine, saved in zip(self._lr_source.param_groups, source):
                    mine.update(saved)
        if sched is not None and load_lr_scheduler_states and self.lr_scheduler is not None \
                and hasattr(self.lr_scheduler, "load_state_dict"):
            self.lr_scheduler.load_state_dict(sched)
        if not load_optimizer_states and self.lr_scheduler is not None and \
                not self._client_scheduler:
            self._write_config_schedule()  # the restored step's lr, as the schedule gives it
        self._lr_pushed = None  # the C++ engine's lr is pushed again at the next step
        return root, client_state

    def _load_client_optimizer(self, root):
        """The client optimizer's state this rank saved (Note [a client optimizer])."""
        saved = _unpickle_trusted(self._cpp.read_client_file(root))
        self._client_optimizer.load_state_dict(saved)
        # torch's load_state_dict makes new group dicts around the same tensors: share them again.
        if self.optimizer is not None:
            self.optimizer.param_groups = self._client_optimizer.param_groups
        self._client_params = [list(g["params"]) for g in self._client_optimizer.param_groups]

    # --- 16-bit weights -----------------------------------------------------------------------
    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters=False):
        """The whole model's state_dict in the working precision (bf16/fp16, else fp32), on the
        CPU, on rank 0; other ranks get an empty dict. Collective under stage 3: each unit is
        gathered in turn, so the device holds one unit at a time."""
        out = self._gathered_state_dict(exclude_frozen_parameters)
        return out if self.global_rank == 0 else {}

    def _gathered_state_dict(self, exclude_frozen_parameters=False):
        self._check_live()
        values = {}
        with torch.no_grad():
            for index, (_, module) in zip(self._unit_index, self._units):
                if self.zero_optimization_stage() >= 3:
                    self._cpp.begin_unit(index, False)
                try:
                    for p in module.parameters():
                        if id(p) not in values:
                            values[id(p)] = p.detach().to("cpu", copy=True)
                finally:
                    if self.zero_optimization_stage() >= 3:
                        self._cpp.end_unit(index, [])
            out = {}
            for name, t in self.module.state_dict(keep_vars=True).items():
                if exclude_frozen_parameters and isinstance(t, torch.nn.Parameter) and \
                        not t.requires_grad:
                    continue
                out[name] = values[id(t)] if id(t) in values else t.detach().to("cpu", copy=True)
        return out

    def module_state_dict(self, destination=None, prefix="", keep_vars=False,
                          exclude_frozen_parameters=False):
        """The model's state_dict. Under stage 3 the parameters have no memory between forwards,
        so every rank gets gathered CPU copies (collective; keep_vars is moot there)."""
        if self.zero_optimization_stage() < 3:
            sd = self.module.state_dict(destination=destination, prefix=prefix,
                                        keep_vars=keep_vars)
            if exclude_frozen_parameters:
                for name, p in self.module.named_parameters():
                    if not p.requires_grad:
                        sd.pop(prefix + name, None)
            return sd
        sd = destination if destination is not None else {}
        for name, t in self._gathered_state_dict(exclude_frozen_parameters).items():
            sd[prefix + name] = t
        return sd

    def load_module_state_dict(self, checkpoint, strict=True, custom_load_fn=None,
                               fetch_z3_params=False, z3_params_to_fetch=None,
                               allowed_missing_keys=None):
        """Loads checkpoint["module"] into the model's weights, the fp32 master and the working
        copy both, from rank 0's values (collective). allowed_missing_keys: keys that may be
        absent under strict loading."""
        from .zero import GatheredParameters
        self._check_live()
        # DeepSpeed's takes the checkpoint dict too; a bare state_dict there fails with
        # KeyError('module'), which names neither the argument nor the fix.
        if not isinstance(checkpoint, Mapping) or "module" not in checkpoint:
            keys = list(checkpoint)[:3] if isinstance(checkpoint, Mapping) else None
            raise InvalidArgumentError(
                "load_module_state_dict takes a checkpoint dict whose 'module' entry is the "
                "model's state_dict, as DeepSpeed's does; got "
                + (f"a dict without 'module' (keys {keys}...)" if keys is not None
                   else type(checkpoint).__name__)
                + ": pass {'module': state_dict}")
        params = [p for p in self.module.parameters()]
        with GatheredParameters(params, modifier_rank=0):
            with torch.no_grad():
                state = checkpoint["module"]
                if custom_load_fn is not None:
                    custom_load_fn(src=state, dst=self.module)
                    return
                result = self.module.load_state_dict(
                    state, strict=strict and allowed_missing_keys is None)
                if strict and allowed_missing_keys is not None:
                    missing = [k for k in result.missing_keys if k not in set(allowed_missing_keys)]
                    if missing or result.unexpected_keys:
                        raise InvalidArgumentError(
                            f"load_module_state_dict: missing keys {missing}, unexpected keys "
                            f"{result.unexpected_keys}")

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin",
                         exclude_frozen_parameters=False):
        """Writes the consolidated 16-bit state_dict (torch.save) to save_dir/save_filename on
        rank 0 and returns True. Under stage 3 this needs
        zero_optimization.stage3_gather_16bit_weights_on_model_save, as in DeepSpeed; without it
        nothing is written and False is returned."""
        if self.zero_optimization_stage() >= 3 and \
                not self.zero_gather_16bit_weights_on_model_save():
            _logger().warning(
                "save_16bit_model: not saved; under ZeRO-3 set zero_optimization."
                "stage3_gather_16bit_weights_on_model_save=true, or use engine.save_checkpoint "
                "and strata's zero_to_fp32")
            return False
        state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            tmp = path + ".tmp"
            torch.save(state, tmp)
            _strata.publish_file(tmp, path)
        return True

    save_fp16_model = save_16bit_model

    # --- offload_states / reload_states ------------------------------------------------------
    # DeepSpeed's state types onto the engine's blocks. Strata keeps no contiguous gradient buffer
    # between steps (gradients are reduced into the grad shards as they arrive), so that type
    # moves nothing.
    _STATE_BLOCKS = {"optim_states": ("exp_avg", "exp_avg_sq"), "hp_params": ("master32",),
                     "lp_params": ("param16",), "lp_grads": ("grad",),
                     "contiguous_grad_buffer": ()}

    def offload_states(self, include=None, device="cpu", pin_memory=True, non_blocking=False):
        """Moves the device-resident states named by `include` (DeepSpeed's OffloadStateTypeEnum
        members or their names; None: all) to host memory and frees their device memory, between
        steps, under ZeRO stage 3, as DeepSpeed's engine does; reload_states() brings them back
        bit for bit, and the engine refuses to train until then. States already off the device
        (cpu/nvme offload) stay where they are. Only device="cpu" is supported, as in DeepSpeed;
        the host copies are ordinary (pageable) memory whatever pin_memory says, and the copy is
        complete when the call returns (non_blocking is accepted and has no effect). Where the
        master is the working shard itself (fp32 compute or a bf16 master, shard and optimizer
        group in one tier), hp_params has no block of its own: it moves with lp_params, and
        until reload_states() reading or writing either (checkpoints, parameter state) is
        refused."""
        self._check_live()
        where = getattr(device, "value", device)
        if where != "cpu":
            raise InvalidArgumentError(f"offload_states(device={where!r}): only 'cpu' is "
                                       "supported (as in DeepSpeed)")
        names = list(self._STATE_BLOCKS) if include is None else \
            [getattr(t, "value", getattr(t, "name", t)) for t in include]
        blocks = []
        for n in names:
            if n not in self._STATE_BLOCKS:
                raise InvalidArgumentError(f"offload_states: unknown state type {n!r}; one of "
                                           f"{sorted(self._STATE_BLOCKS)}")
            blocks += [b for b in self._STATE_BLOCKS[n] if b not in blocks]
        self._cpp.offload_states(blocks)
        self._states_offloaded = True

    def reload_states(self, non_blocking=False):
        """Brings every state offload_states moved back to the device."""
        self._check_live()
        self._cpp.reload_states()
        self._states_offloaded = False

    def _check_states_resident(self, what):
        if getattr(self, "_states_offloaded", False):
            raise InvalidArgumentError(f"engine.{what} while states are offloaded to host memory "
                                       "(offload_states): call engine.reload_states() first")

    # --- teardown -----------------------------------------------------------------------------
    def close(self):
        """Frees the engine's memory, NVMe files and threads now and removes its hooks. The model
        keeps no trained values afterwards (under stage 3 its parameters are empty): save a
        checkpoint first, or call destroy(), which gives the model its weights back. Refused
        while a call into the engine runs (from a hook inside backward, or another thread)."""
        self._cpp.begin_close()
        self._hooks.remove()
        _param_state.detach(self, keep_shapes=self.zero_optimization_stage() >= 3)
        self._cpp.close()
        _live_engines.pop(id(self), None)
        if self._replaced_by is None:
            self._replaced_by = _CLOSED

    def destroy(self):
        """Ends the engine and gives the model its trained fp32 weights back as ordinary
        tensors on the engine's device, so the model can be used in plain PyTorch or handed to
        initialize again: buffers and frozen parameters, which a 16-bit run computes with in
        its dtype, take back the dtype initialize found them in. Collective under stage 3
        (every rank calls it)."""
        if self._replaced_by is not None:
            return
        self._cpp.check_closable()
        values = self.master_parameters()
        self.close()
        with torch.no_grad():
            for p, v in zip(self._trained, values):
                _param_state.give_values_back(p, v.to(self._device))
            found = getattr(self, "_found_dtypes", {})
            for t in itertools.chain(self.module.buffers(), self.module.parameters()):
                dtype = found.get(id(t))
                if dtype is not None and t.dtype != dtype:
                    t.data = t.data.to(dtype)

    def _module_keys(self):
        """How the module's state_dict names map onto the checkpoint's entries, for
        strata.zero_to_fp32: a parameter shared by several modules is saved once, under its
        first name (the others are aliases), and only persistent buffers belong in a
        state_dict."""
        first = {}
        for name, p in self.module.named_parameters():
            first.setdefault(id(p), name)
        aliases, buffers = {}, []
        for name, t in self.module.state_dict(keep_vars=True).items():
            if isinstance(t, torch.nn.Parameter):
                if first.get(id(t), name) != name:
                    aliases[name] = first[id(t)]
            else:
                buffers.append(name)
        return {"aliases": aliases, "buffers": buffers}

    def _check_forward_after_end(self):
        """A forward through an engine that no longer trains runs the plain model, where the
        model still has its weights (destroy(), or close() below stage 3). Under stage 3 close()
        leaves the parameters empty, and PyTorch's own error ("'weight' must be 2-D") would name
        neither; a model taken over by a later initialize belongs to that engine."""
        if self._replaced_by != _CLOSED:
            raise InvalidArgumentError(f"engine.forward: this engine no longer trains "
                                       f"({self._replaced_by}): call the new engine")
        if any(_param_state.emptied_by_a_closed_engine(p) for p in self.module.parameters()):
            raise InvalidArgumentError(
                "engine.forward: this engine was closed, and under ZeRO stage 3 close() leaves "
                "the model's parameters empty; call engine.destroy() instead of close() to give "
                "the model its weights back, or load a checkpoint into a new engine")

    def _check_live(self):
        if self._replaced_by is not None:
            raise InvalidArgumentError(f"this engine no longer trains: {self._replaced_by}")

    def _units_of_param(self, param):
        """The units holding `param` (empty for a root parameter), or None when the model has no
        such parameter."""
        if id(param) not in self._model_params:
            return None
        return self._param_units.get(id(param), set())

    def _cpp_optimizer_type(self):
        """The optimizer the engine runs, lower case ("adam", "adamw", "sgd", "adagrad", "lion")."""
        return str(self._config.get("optimizer", {}).get("type", "adam")).lower()

    def master_parameters(self):
        """The fp32 master value of every trainable parameter, in the model's named_parameters
        order (shared parameters once). Collective: every rank calls it."""
        return self._cpp.master_params()


def _refused_on_the_class(name):
    def refused(self):
        raise _surface.refusal(name)

    return property(refused)


# A refused name that torch.nn.Module has itself (compile, from torch 2.2 on) is found on the class
# before __getattr__ is asked: it would compile the engine's forward around the unit hooks. The
# engine's class refuses it instead, with the same error (an AttributeError: hasattr is False).
for _name in _surface.REFUSED_NAMES:
    if hasattr(torch.nn.Module, _name):
        setattr(StrataEngine, _name, _refused_on_the_class(_name))


# Engines alive in this process, for strata.zero.GatheredParameters; an engine nobody holds any
# more leaves by itself.
_live_engines = weakref.WeakValueDictionary()


# client_state's key for the client LR scheduler's state_dict.
_SCHEDULER_KEY = "__strata_lr_scheduler__"
_OPTIMIZER_KEY = "__strata_optimizer_groups__"
_LR_SOURCE_KEY = "__strata_lr_source_groups__"


def _logger():
    import logging

    return logging.getLogger("strata")


def _checked_tag(method, tag):
    """A tag names one folder inside the checkpoint directory: os.path.join would take an absolute
    tag, '..' or a path with separators outside it (over another run's checkpoints)."""
    name = str(tag)
    if name in ("", ".", "..") or "/" in name or os.sep in name or "\0" in name:
        raise InvalidArgumentError(
            f"{method}(tag={tag!r}): a tag is one folder name inside the checkpoint directory "
            f"(such as 'global_step100'), without '/', not '.' or '..', and not empty")
    # The directory's `latest` file names the last tag, read back stripped (as DeepSpeed reads
    # it): a tag of that name would be a folder in its place, and one with outer spaces would
    # be read back as another tag.
    if name == "latest" or name != name.strip():
        raise InvalidArgumentError(
            f"{method}(tag={tag!r}): 'latest' is the file that names the last tag, and a tag "
            "cannot begin or end with white space; choose another tag (such as 'global_step100')")
    return name


def _drop_older_steps(root, kept):
    """One checkpoint per tag, as DeepSpeed's save into a tag replaces that tag's files: the
    engine names each save's folder in the tag after its step, so a script saving under one tag
    ("last") kept every step's copy and filled the disk. The new one is published and named
    before the older ones go; one that cannot be removed is left with a warning."""
    import re
    import shutil

    for name in os.listdir(root):
        if name != kept and re.fullmatch(r"step-\d{8}", name):
            try:
                shutil.rmtree(os.path.join(root, name))
            except OSError as e:
                _logger().warning("save_checkpoint: could not remove the tag's older %s (%s)",
                                  name, e)


def _resolve_checkpoint(load_dir, tag):
    """The directory to load: load_dir/<tag>, or the tag `latest` names, or load_dir itself when
    it is one checkpoint (a step directory, as strata-train --resume takes); None, with a
    warning as DeepSpeed gives, when it holds none."""
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.exists(latest):
            if os.path.isfile(os.path.join(load_dir, "rank-00000.json")):
                return load_dir
            _logger().warning(
                "load_checkpoint: %s holds no 'latest' file and no checkpoint, so nothing was "
                "loaded; pass the directory save_checkpoint wrote to, or an explicit tag", load_dir)
            return None
        try:
            with open(latest, "rb") as f:
                name = f.read().decode("utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidArgumentError(
                f"load_checkpoint: {latest} should be a text file naming the last saved tag, "
                f"and it cannot be read as one ({e}); pass tag=... explicitly") from None
        tagged = os.path.join(load_dir, name)
        # A tagged save keeps its own `latest`; an older untagged one is load_dir itself.
        return tagged if os.path.exists(os.path.join(tagged, "latest")) else load_dir
    root = os.path.join(load_dir, _checked_tag("load_checkpoint", tag))
    if not os.path.isdir(root):
        raise InvalidArgumentError(f"load_checkpoint: no checkpoint tagged '{tag}' in {load_dir}")
    return root


def _unpickle_trusted(data):
    """client_state: weights-only unpickling when the content allows, else the full unpickler
    (the checkpoint is trusted input, see load_checkpoint)."""
    import pickle

    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError:
        return torch.load(io.BytesIO(data), weights_only=False)


__all__ = ["StrataEngine", "StrataError"]


class _SingleGroup:
    """The data-parallel group of a process that never initialised torch.distributed."""

    @staticmethod
    def rank():
        return 0

    @staticmethod
    def size():
        return 1
