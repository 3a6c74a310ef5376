"""deepspeed.pipe over Strata: DeepSpeed's pipeline API (PipelineModule, LayerSpec, TiedLayerSpec,
ProcessTopology and the engine's train_batch / eval_batch) with every stage on each rank.

Note [pipelines on one rank]
DeepSpeed splits a PipelineModule's layers into num_stages stages, one per rank of a pipeline
group, and streams micro-batches through them; the world is num_stages x dp ranks, and the dp
pipeline groups split the batch. Strata is a data-parallel engine with offload: it runs the
whole layer list on each rank, and gives the script DeepSpeed's numbers.

  - The ranks of one pipeline group (ranks r with the same r % dp, as DeepSpeed's
    PipeDataParallelTopology numbers them) read the same micro-batches: the loader is
    DeepSpeed's pipeline loader, the data in order over the dp groups, repeating. Their
    gradients are equal, so the engine's all-rank mean is DeepSpeed's mean over the dp groups.
  - The weights are DeepSpeed's: each stage's layers are built from the random state DeepSpeed's
    stage ranks build them from (Note [the weights of a pipeline]), with its stage boundaries.
    Against DeepSpeed 0.19.6 on one and on two stages, train_batch returned the same losses to
    every printed digit.
  - train_batch() runs gradient_accumulation_steps micro-batches (forward, loss_fn, backward),
    then the step, and returns the micro-batches' mean loss averaged over the dp groups, on every
    rank, as DeepSpeed broadcasts it.
  - train_batch_size() is micro x accumulation x dp (DeepSpeed's); dp_world_size, stage_id,
    num_stages, is_first_stage() and is_last_stage() are what DeepSpeed's topology gives.

What differs, on purpose: each rank holds every layer, so a pipeline does not spread a model
that does not fit one device (ZeRO stage 3 with offload does that; ZeRO 1-3 run with a
PipelineModule here, where DeepSpeed refuses 2 and 3). initialize warns once with the stage
count.
"""

import functools
import re

import torch

from . import checkpointing as _checkpointing
from ._strata import InvalidArgumentError
# The topologies are importable from here too, as from deepspeed.pipe.
from .pipe_topology import (PipeDataParallelTopology, PipeModelDataParallelTopology,  # noqa: F401
                            ProcessTopology)
from .runtime_utils import set_random_seed


class LayerSpec:
    """A layer to build later: typename(*module_args, **module_kwargs)."""

    def __init__(self, typename, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, torch.nn.Module)):
            raise InvalidArgumentError(f"LayerSpec({typename!r}): the type must be a "
                                       "torch.nn.Module subclass")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def __repr__(self):
        args = [repr(a) for a in self.module_args] + \
            [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"

    def build(self, log=False):
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer shared by every spec with the same key (built once); forward_fn(module, x), when
    given, replaces the module's forward at this position."""

    def __init__(self, key, typename, *module_args, forward_fn=None, tied_weight_attr=("weight",),
                 **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) \
            else list(tied_weight_attr)


def _layer_name(layer):
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, torch.nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", "")


def _uniform_parts(n, parts):
    """Stage boundaries for n layers, as even as can be (the first n % parts stages one more)."""
    if n <= parts:
        return [min(p, n) for p in range(parts + 1)]
    size, extra = divmod(n, parts)
    return [p * size + min(p, extra) for p in range(parts + 1)]


def _balanced_parts(weights, parts):
    """Stage boundaries that split `weights` into `parts` contiguous runs whose largest and
    smallest sums are closest (the linear partition problem, by dynamic programming, as
    DeepSpeed's partition_balanced solves it; among equally good splits the last run starts as
    late as possible). The boundaries decide which layers a stage builds from the same random
    state (Note [the weights of a pipeline]), so they are DeepSpeed's."""
    n = len(weights)
    if n <= parts:
        return _uniform_parts(n, parts)
    inf = float("inf")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    cost = [[inf] * (parts + 1) for _ in range(n + 1)]
    high = [[inf] * (parts + 1) for _ in range(n + 1)]
    low = [[inf] * (parts + 1) for _ in range(n + 1)]
    cut = [[0] * (parts + 1) for _ in range(n + 1)]
    cost[0][0], high[0][0] = 0.0, 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, parts) + 1):
            for k in range(i):
                run = prefix[i] - prefix[k]
                hi, lo = max(high[k][j - 1], run), min(low[k][j - 1], run)
                if cost[i][j] >= hi - lo:
                    cost[i][j], high[i][j], low[i][j], cut[i][j] = hi - lo, hi, lo, k
    bounds = [n]
    for j in range(parts, 0, -1):
        bounds.append(cut[bounds[-1]][j])
    return bounds[::-1]


def _world():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    import os
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


class PipelineModule(torch.nn.Module):
    """DeepSpeed's PipelineModule: `layers` (nn.Modules, LayerSpecs, TiedLayerSpecs or plain
    callables) run in order, the output of one the input of the next; loss_fn(outputs, labels)
    gives train_batch's loss. Every layer is built here (Note [pipelines on one rank]); layer i is
    registered as submodule str(i), tied layers under tied_modules.<key>, as DeepSpeed names
    them, so state dicts carry DeepSpeed's keys."""

    def __init__(self, layers, num_stages=None, topology=None, loss_fn=None, seed_layers=False,
                 seed_fn=None, base_seed=1234, partition_method="parameters",
                 activation_checkpoint_interval=0,
                 activation_checkpoint_func=_checkpointing.checkpoint, checkpointable_layers=None,
                 dynamic_shape=False, **ignored):
        super().__init__()
        if num_stages is None and topology is None:
            raise InvalidArgumentError("PipelineModule: give num_stages or topology")
        world, rank = _world()
        if topology is not None:
            num_stages = topology.get_dim("pipe")
            if topology.world_size() != world:
                raise InvalidArgumentError(
                    f"PipelineModule: the topology has {topology.world_size()} ranks but the "
                    f"world has {world}")
        num_stages = int(num_stages)
        if num_stages < 1 or world % num_stages != 0:
            raise InvalidArgumentError(
                f"PipelineModule(num_stages={num_stages}): the world of {world} rank(s) must be "
                "a multiple of num_stages (num_stages x data-parallel ranks)")
        self.num_stages = num_stages
        self.dp_world_size = world // num_stages
        self._topo = topology or PipeDataParallelTopology(num_stages, self.dp_world_size)
        self.global_rank = rank
        self.stage_id = rank // self.dp_world_size
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.micro_offset = 0
        self._layer_specs = list(layers)
        self.parts = self._partition(str(partition_method).lower())
        self.forward_funcs = []
        self.fwd_map = {}
        self.tied_modules = torch.nn.ModuleDict()
        self.tied_weight_attrs = {}
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, PipelineModule):
                raise InvalidArgumentError(f"PipelineModule: layer {idx} is a PipelineModule; "
                                           "nest its layers in the list instead")
            if not isinstance(layer, (torch.nn.Module, LayerSpec)) and not callable(layer):
                raise InvalidArgumentError(
                    f"PipelineModule: layer {idx} is a {type(layer).__name__}; each layer is an "
                    "nn.Module, a LayerSpec, a TiedLayerSpec or a callable")
        # Note [the weights of a pipeline]: DeepSpeed builds each stage's layers on that
        # stage's rank, every rank from the generator's state after the partitioning, and gives
        # a tied module the weights of its first stage. Built stage by stage from that same
        # state here, the layers get DeepSpeed's weights for any number of stages; this rank's
        # generator ends where its own stage's build leaves it, as under DeepSpeed.
        start = torch.random.get_rng_state()
        own = start
        for stage in range(self.num_stages):
            torch.random.set_rng_state(start)
            tied_here = set()
            for idx in range(self.parts[stage], self.parts[stage + 1]):
                self._build_layer(idx, tied_here)
            if stage == self.stage_id:
                own = torch.random.get_rng_state()
        torch.random.set_rng_state(own)

    def _build_layer(self, idx, tied_here):
        layer = self._layer_specs[idx]
        if self.seed_layers:
            (self.seed_fn or set_random_seed)(self.base_seed + idx)
        if isinstance(layer, torch.nn.Module):
            self._add(str(idx), layer)
        elif isinstance(layer, TiedLayerSpec):
            if layer.key not in tied_here:  # each stage holding the key builds its copy
                tied_here.add(layer.key)
                copy = layer.build()
                if layer.key not in self.tied_modules:  # the first stage's weights are kept
                    self.tied_modules[layer.key] = copy
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
            module = self.tied_modules[layer.key]
            self.forward_funcs.append(module if layer.forward_fn is None
                                      else functools.partial(layer.forward_fn, module))
        elif isinstance(layer, LayerSpec):
            self._add(str(idx), layer.build())
        else:
            self.forward_funcs.append(layer)

    def _partition(self, method):
        """Where each stage's layers would begin (and the end), by DeepSpeed's methods. Every
        layer runs on each rank here, so the split is only reported (partitions()); but
        "parameters", DeepSpeed's default, counts each LayerSpec's parameters by building it
        once, as DeepSpeed does, which draws from the random generator before the real build:
        done here too, so a one-stage pipeline starts from DeepSpeed's weights."""
        n = len(self._layer_specs)
        if method == "uniform":
            weights = None
        elif method == "parameters":
            weights = []
            for layer in self._layer_specs:
                module = layer.build() if isinstance(layer, LayerSpec) else layer
                weights.append(sum(p.numel() for p in module.parameters() if p.requires_grad)
                               if isinstance(module, torch.nn.Module) else 0)
        elif method.startswith("type:"):
            pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
            weights = [1 if pattern.search(_layer_name(layer)) else 0 for layer in self._layer_specs]
            if not any(weights):
                raise InvalidArgumentError(f"PipelineModule(partition_method={method!r}): no layer's "
                                           "type matches; name one of the layers' classes")
        else:
            raise InvalidArgumentError(f"PipelineModule(partition_method={method!r}): "
                                       "'parameters', 'uniform' or 'type:<regex>', as DeepSpeed "
                                       "implements")
        if method == "uniform":
            return _uniform_parts(n, self.num_stages)
        return _balanced_parts(weights, self.num_stages)

    def _add(self, name, module):
        self.forward_funcs.append(module)
        self.fwd_map[name] = len(self.forward_funcs) - 1
        self.add_module(name, module)

    def _run(self, start, end):
        def run(*inputs):
            x = inputs[0] if len(inputs) == 1 else inputs  # one tensor travels unwrapped
            for idx in range(start, end):
                if self.seed_layers:
                    (self.seed_fn or torch.manual_seed)(self.base_seed * (self.micro_offset + 1) + idx)
                x = self.forward_funcs[idx](x)
            return x
        return run

    def _checkpointable(self, funcs):
        if self.checkpointable_layers is not None:
            return any(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(len(list(f.parameters())) > 0 for f in funcs if isinstance(f, torch.nn.Module))

    def forward(self, forward_input):
        self.micro_offset += 1
        n = len(self.forward_funcs)
        interval = self.activation_checkpoint_interval
        if interval == 0 or not torch.is_grad_enabled():
            return self._run(0, n)(forward_input)
        x = forward_input
        for start in range(0, n, interval):
            end = min(start + interval, n)
            if not isinstance(x, tuple):
                x = (x,)
            if self._checkpointable(self.forward_funcs[start:end]):
                x = self.activation_checkpoint_func(self._run(start, end), *x)
            else:
                x = self._run(start, end)(*x)
        return x

    def topology(self):
        return self._topo

    def num_pipeline_stages(self):
        return self.num_stages

    def partitions(self):
        """Where each stage's layers would begin, and the end (by partition_method); the layers
        all run on each rank here."""
        return list(self.parts)

    def get_tied_weights_and_groups(self):
        return []

    def allreduce_tied_weight_gradients(self):
        """Tied layers are one module here: their gradient is already summed."""
