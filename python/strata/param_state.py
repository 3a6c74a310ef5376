"""One parameter's share of the engine's states, as DeepSpeed exposes it:

  - deepspeed.utils' accessors: safe_get_full_fp32_param, safe_set_full_fp32_param,
    safe_get_full_optimizer_state, safe_set_full_optimizer_state, and the local (this rank's
    shard only) getters. They work at every stage, read and write the engine's real states
    wherever they live (device, host, NVMe), and are collective when several ranks train, as
    DeepSpeed's are: every rank calls them with the same parameter. A parameter no engine
    trains gives None (get) or nothing happens (set), as in DeepSpeed;
  - ZeRO-3's parameter attributes (deepspeed.runtime.zero.partition_parameters): under stage 3
    each trained parameter has ds_id, ds_shape, ds_numel, ds_param_type, and two that ask the
    engine when read: ds_status (is its chunk gathered on this rank now) and ds_tensor (a copy
    of this rank's shard of its working copy, flat; writing to it changes nothing).

As in DeepSpeed's stage 3, a parameter whose chunk is not gathered has 0 elements (reading it
gives an empty result); ds_shape and ds_numel keep its real shape, and ds_status tells whether it
is gathered. After the engine is closed every such parameter stays empty and keeps ds_shape and
ds_numel (engine.destroy() gives it its values back).
"""

import enum
import itertools
import math
import weakref

import torch

from . import engine as _engine
from ._strata import InvalidArgumentError
from .unsupported import NotSupportedError


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1      # gathered on this rank: the parameter's values are readable
    NOT_AVAILABLE = 2  # partitioned: only the shards exist
    INFLIGHT = 3       # a gather ahead is landing


class ZeroParamType(enum.Enum):
    NORMAL = 1
    PARTITIONED = 2
    REMOTE = 3


# Engine::Residency's order (python/bindings/py_param_state.cc).
_STATUS = (ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.INFLIGHT)

# The optimizer's state keys, as torch's optimizers name them in optimizer.state[p], onto the
# engine's state kinds.
_STATE_KEYS = {
    "adam": {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
    "adamw": {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
    "sgd": {"momentum_buffer": "exp_avg"},
    "adagrad": {"sum": "exp_avg_sq"},
    "lion": {"exp_avg": "exp_avg"},
}

_ids = itertools.count()


def _engine_of(param):
    """The live engine that trains `param`, or None."""
    if not isinstance(param, torch.Tensor) or not param.requires_grad:
        return None
    for engine in list(_engine._live_engines.values()):
        if engine._units_of_param(param) is not None:
            return engine
    return None


def _state_kind(engine, key):
    if engine._client_params is not None:
        raise NotSupportedError(
            f"optimizer state {key!r}: the client optimizer "
            f"({type(engine.client_optimizer).__name__}) runs itself and keeps its own state; "
            "read engine.client_optimizer.state")
    optimizer = engine._cpp_optimizer_type()
    keys = _STATE_KEYS.get(optimizer, {})
    if key not in keys:
        raise KeyError(f"optimizer state {key!r}: the {optimizer} optimizer's states are "
                       f"{sorted(keys) or 'none'}")
    return keys[key]


def _read(param, key, local):
    """The state `key` (None: the fp32 master) of `param`, whole (collective) or this rank's
    shard, on the engine's device; None for a parameter no engine trains."""
    engine = _engine_of(param)
    if engine is None:
        return None
    kind = "master32" if key is None else _state_kind(engine, key)
    read = engine._cpp.local_param_state if local else engine._cpp.gather_param_state
    return read(kind, [param])[0].to(engine.device)


def _write(param, key, value):
    engine = _engine_of(param)
    if engine is not None:
        kind = "master32" if key is None else _state_kind(engine, key)
        engine._cpp.write_param_state(kind, [param], [_checked(param, value)])


# --- deepspeed.utils ------------------------------------------------------------------------------
def safe_get_full_fp32_param(param):
    """The parameter's fp32 master value, whole and shaped as the parameter, on the engine's
    device; None for a parameter no engine trains."""
    return _read(param, None, local=False)


def safe_set_full_fp32_param(param, value):
    """Writes `value` (the parameter's shape or numel) into its fp32 master; the working copy
    follows at once. The optimizer states are untouched."""
    _write(param, None, value)


def safe_get_full_optimizer_state(param, optim_state_key):
    """One of the optimizer's states for the parameter (Adam/AdamW: "exp_avg", "exp_avg_sq";
    SGD with momentum: "momentum_buffer"; Adagrad: "sum"; Lion: "exp_avg"), whole, in fp32, on
    the engine's device; None for a parameter no engine trains."""
    return _read(param, optim_state_key, local=False)


def safe_set_full_optimizer_state(param, value, optim_state_key):
    _write(param, optim_state_key, value)


def safe_get_local_fp32_param(param):
    """This rank's elements of the parameter's fp32 master (flat; no collective)."""
    return _read(param, None, local=True)


def safe_get_local_optimizer_state(param, optim_state_key):
    return _read(param, optim_state_key, local=True)


def _refused(name, what, instead):
    def refused(*args, **kwargs):
        raise NotSupportedError(f"{name}: {what} is not implemented by Strata; {instead}")

    refused.__name__ = name
    return refused


_NO_GRADS = ("reading or writing a parameter's gradient between backward and step",
             "the engine reduces each gradient into its shard during backward and may update "
             "the parameter before step(); use engine.get_global_grad_norm() for the norm and "
             "gradient_clipping in the config to clip")
safe_get_full_grad = _refused("safe_get_full_grad", *_NO_GRADS)
safe_set_full_grad = _refused("safe_set_full_grad", *_NO_GRADS)
safe_get_local_grad = _refused("safe_get_local_grad", *_NO_GRADS)
safe_set_local_grad = _refused("safe_set_local_grad", *_NO_GRADS)
_LOCAL_WRITE = ("writing one rank's slice of a parameter's state",
                "write the whole value with safe_set_full_fp32_param or "
                "safe_set_full_optimizer_state")
safe_set_local_fp32_param = _refused("safe_set_local_fp32_param", *_LOCAL_WRITE)
safe_set_local_optimizer_state = _refused("safe_set_local_optimizer_state", *_LOCAL_WRITE)


def _checked(param, value):
    shape = tuple(getattr(param, "ds_shape", param.shape))  # stage 3: it may have 0 elements now
    if not isinstance(value, torch.Tensor):
        raise InvalidArgumentError(f"a value for a parameter of shape {shape} must be a tensor, "
                                   f"not {type(value).__name__}")
    if value.numel() != math.prod(shape):
        raise InvalidArgumentError(f"a value of shape {tuple(value.shape)} for a parameter of "
                                   f"shape {shape}")
    return value.detach()


# --- ZeRO-3's parameter attributes -----------------------------------------------------------------
class _ZeroAttributes:
    """Mixed into a stage-3 parameter's class: the attributes that ask the engine."""

    def _strata_live_engine(self):
        ref = self.__dict__.get("_strata_engine")
        engine = ref() if ref is not None else None
        return engine if engine is not None and engine._replaced_by is None else None

    @property
    def ds_status(self):
        engine = self._strata_live_engine()
        if engine is None:
            return ZeroParamStatus.AVAILABLE  # given back (destroy) or never partitioned
        return _STATUS[engine._cpp.param_residency([self])[0]]

    @property
    def ds_tensor(self):
        engine = self._strata_live_engine()
        if engine is None:
            return None
        return engine._cpp.local_param_state("param16", [self])[0].to(engine.device)


_classes = {}


def _zero_class(base):
    """`base` with the ZeRO-3 attributes, under base's own name (so that repr and messages read
    as before; pickling a Parameter rebuilds a plain one)."""
    if issubclass(base, _ZeroAttributes):
        return base
    if base not in _classes:
        _classes[base] = type(base.__name__, (_ZeroAttributes, base),
                              {"__module__": base.__module__, "_strata_base": base})
    return _classes[base]


def shapes_of(model):
    """Each trainable parameter's shape, by id, taken before an engine partitions the model."""
    return {id(p): p.shape for p in model.parameters() if p.requires_grad}


def attach(engine, shapes):
    """Under stage 3: each parameter the engine trains gets DeepSpeed's ds_* attributes.
    shapes: shapes_of(model) from before the engine (its parameters may now have 0 elements)."""
    if engine.zero_optimization_stage() < 3:
        return
    seen = set()
    for p in engine.module.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        p.ds_id = next(_ids)
        p.ds_shape = shapes[id(p)]
        p.ds_numel = shapes[id(p)].numel()
        p.ds_param_type = ZeroParamType.PARTITIONED
        p._strata_engine = weakref.ref(engine)
        p.__class__ = _zero_class(type(p))


def detach(engine, keep_shapes):
    """The engine ends: its parameters get their own class back and lose the attributes that
    ask it. With keep_shapes (a closed stage-3 engine leaves them with 0 elements) ds_shape and
    ds_numel stay, as DeepSpeed leaves them, to tell the real shape; otherwise they go too."""
    for p in engine.module.parameters():
        ref = p.__dict__.get("_strata_engine")
        if ref is None or ref() is not engine:
            continue
        names = ("ds_id", "ds_param_type", "_strata_engine")
        if not keep_shapes:
            names += ("ds_shape", "ds_numel")
        for name in names:
            p.__dict__.pop(name, None)
        p.__class__ = type(p)._strata_base


def emptied_by_a_closed_engine(p):
    """Whether `p` is a parameter a closed stage-3 engine left without its values."""
    return p.numel() == 0 and p.__dict__.get("ds_numel", 0) > 0


def give_values_back(p, value):
    """destroy(): `value` (flat or shaped) becomes p's data, in p's real shape, and the shape
    attributes detach left go."""
    shape = p.__dict__.pop("ds_shape", None)
    p.__dict__.pop("ds_numel", None)
    p.data = value.view(shape if shape is not None else p.shape)
