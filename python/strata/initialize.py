"""strata.initialize: DeepSpeed's entry point, over Strata's engine."""

import itertools
import json
import os
import warnings

import torch

from . import _strata
from . import arguments as _arguments
from . import comm as _comm
from . import config as _config
from . import cpu_half as _cpu_half
from . import engine as _engine_mod
from . import param_state as _param_state
from . import pipe as _pipe
from . import pipe_engine as _pipe_engine
from . import units as _units
from ._strata import InvalidArgumentError
from .engine import StrataEngine
from .optimizer import ConfigSchedule, StrataOptimizer


def _groups_of(optimizer, model_parameters):
    """The parameter groups as dicts: the client optimizer's, else model_parameters' when they
    are dicts (DeepSpeed takes groups either way), else None (one group, the config's)."""
    if optimizer is not None:
        return optimizer.param_groups
    if isinstance(model_parameters, (list, tuple)) and model_parameters and \
            all(isinstance(g, dict) for g in model_parameters):
        return model_parameters
    return None


def _engine_groups(optimizer, model_parameters, cfg):
    """What the C++ engine takes: [(trainable params, [lr, beta1, beta2, eps, weight_decay])]."""
    groups = _groups_of(optimizer, model_parameters)
    if groups is None:
        return []
    defaults = cfg.get("optimizer", {}).get("params", {})
    return [([p for p in g["params"] if p.requires_grad], _config.group_hyperparameters(g, defaults))
            for g in groups]


def _check_client_optimizer(cfg, source, optimizer, refused):
    """Whether `optimizer`, which Strata does not run itself (`refused` says why), may run as it
    is, on the device, over this rank's partition (Note [a client optimizer]): as DeepSpeed, at
    stage 0 always and at stages 1-2 with zero_allow_untested_optimizer; unlike DeepSpeed, never at
    stage 3 or with offload, where the partition is not in device memory for the optimizer to
    step."""
    z = cfg.get("zero_optimization") or {}
    stage = int(z.get("stage", 0))
    name = type(optimizer).__name__
    if stage > 0 and not cfg.get("zero_allow_untested_optimizer", False):
        raise InvalidArgumentError(
            f"{refused}; or set \"zero_allow_untested_optimizer\": true in {source} to run "
            f"{name} itself on the device over this rank's partition (ZeRO stages 0-2 without "
            "offload), as DeepSpeed does") from None
    offloaded = [k for k in ("offload_optimizer", "offload_param")
                 if str((z.get(k) or {}).get("device", "none")).lower() not in ("none", "")]
    if stage == 3 or offloaded:
        where = f"zero_optimization.stage {stage}" if stage == 3 else \
            " and ".join(f"{k}.device={z[k]['device']}" for k in offloaded)
        raise InvalidArgumentError(
            f"optimizer={name} runs itself only over a partition in device memory (ZeRO stages "
            f"0-2 without offload), and {source} has {where}; Strata's own optimizers (Adam, "
            "AdamW, SGD, Adagrad, Lion) run at every stage and with offload. (DeepSpeed also runs "
            "an untested optimizer under stage 3; Strata does not.)") from None


def _torch_groups(model_parameters, trainable):
    """StrataOptimizer's groups when no client optimizer lends its own: model_parameters' dicts
    (a generator was consumed by the check before: the trainable parameters stand for it)."""
    groups = _groups_of(None, model_parameters)
    return [dict(g, params=list(g["params"])) for g in groups] if groups is not None else trainable


def _check_model_parameters(model, model_parameters):
    if model_parameters is None:
        return
    given = []
    for p in model_parameters:
        if isinstance(p, dict):
            given.extend(p["params"])
        else:
            given.append(p)
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    seen = set()
    for p in given:
        if not isinstance(p, torch.Tensor):
            raise InvalidArgumentError(
                f"model_parameters holds a {type(p).__name__} ({p!r:.40}), not a parameter: pass "
                "the model's trainable parameters or parameter-group dicts of them")
        if id(p) not in names:
            raise InvalidArgumentError(
                f"model_parameters holds a tensor of shape {tuple(p.shape)} that is not a trainable "
                "parameter of the model (another model's, a copy, or one with requires_grad=False)")
        seen.add(id(p))  # one in two groups is refused with the groups' numbers, later
    missing = [n for i, n in names.items() if i not in seen]
    if missing:
        shown = ", ".join(f"'{n}'" for n in missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise InvalidArgumentError(
            "model_parameters must be the model's trainable parameters (those with "
            f"requires_grad): {len(missing)} of {len(names)} are missing ({shown}); to freeze "
            "some, set requires_grad=False on them before initialize")


def _owner_of(model):
    """The live engine that already trains `model`, if any."""
    for engine in list(_engine_mod._live_engines.values()):
        if engine.module is model:
            return engine
    return None


def _check_parameters_have_memory(model):
    for name, p in model.named_parameters():
        if p.is_meta:
            raise InvalidArgumentError(
                f"initialize: parameter {name!r} is on the meta device (no values): materialize "
                "the model first (to_empty() then its initializers, or load its weights), or "
                "build it under deepspeed.zero.Init")
        if _param_state.emptied_by_a_closed_engine(p) or (p.numel() > 0 and p.data_ptr() == 0):
            raise InvalidArgumentError(
                f"initialize: parameter {name!r} has no memory: the model belonged to a ZeRO-3 "
                "engine that was closed; call engine.destroy() instead of close() to give the "
                "model its weights back, or build a new model and load a checkpoint")


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port=None, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, mesh_param=None, config_params=None):
    """Returns (engine, optimizer, training_dataloader, lr_scheduler) as DeepSpeed does.

    config: a dict or the path of a DeepSpeed JSON file (or args.deepspeed_config).
    optimizer: None (the config's "optimizer" section), a torch.optim.Adam/AdamW/SGD/Adagrad (or
    deepspeed.ops' DeepSpeedCPUAdam, FusedAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion,
    FusedLion) whose hyperparameters become that section, or a callable that takes the model's
    parameters (model_parameters when given) and returns one.
    training_data: a torch Dataset; the returned DataLoader yields this rank's micro-batches.

    With several ranks, torch's default process group is created first (init_distributed), as
    DeepSpeed does, so the script's own torch.distributed calls work.

    A second initialize on a model that a live engine already trains returns that engine (with
    a loader for the new training_data) when the config is the same; with another config the
    first engine hands the model its weights (destroy) and a new engine takes over.
    """
    if model is None:
        raise InvalidArgumentError("initialize: model is required")
    if not isinstance(model, torch.nn.Module):
        raise InvalidArgumentError(f"initialize: model must be a torch.nn.Module, not "
                                   f"{type(model).__name__}")
    if mpu is not None:
        raise InvalidArgumentError("initialize: mpu (model parallelism) is not supported; "
                                   "Strata partitions data-parallel ranks only (ZeRO 0-3)")
    if config is None:
        config = config_params
    if config is None:
        config = _arguments.config_from_args(args)
    if config is None:
        # As DeepSpeed: a run without a config is a mistake more often than a wish for defaults.
        raise InvalidArgumentError(
            "initialize: no config: pass config= (a dict or the path of a DeepSpeed JSON file), "
            "or args parsed with --deepspeed_config; config={} runs on the defaults")
    cfg, source = _config.load(config)
    if model_parameters is not None and (
            isinstance(model_parameters, (torch.Tensor, dict, str, bytes)) or
            not hasattr(model_parameters, "__iter__")):
        raise InvalidArgumentError(
            f"model_parameters={type(model_parameters).__name__}: must be an iterable of "
            "parameters or of parameter-group dicts (e.g. model.parameters())")
    if model_parameters is not None and not isinstance(model_parameters, (list, tuple)):
        # A generator (model.parameters()) is read more than once below: by an optimizer
        # callable and by the checks.
        model_parameters = list(model_parameters)
    user_cfg = json.loads(json.dumps(cfg))
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise InvalidArgumentError(
                f"initialize: optimizer={type(optimizer).__name__} is neither a torch optimizer "
                "(Adam, AdamW, SGD, Adagrad, or deepspeed.ops') nor a callable that takes the "
                "model's parameters and returns one")
        # As DeepSpeed: a callable gets model_parameters (or the model's) and builds the optimizer.
        built = optimizer(model_parameters if model_parameters is not None else model.parameters())
        if not isinstance(built, torch.optim.Optimizer):
            raise InvalidArgumentError(f"initialize: the optimizer callable returned "
                                       f"{type(built).__name__}, not a torch optimizer")
        optimizer = built
    hints = _strata.AutoHints()
    client_runs_itself = False
    if optimizer is not None:
        if "optimizer" in cfg:
            warnings.warn(f"{source}: both the config's \"optimizer\" and optimizer= were given; "
                          "the optimizer object wins, as with DeepSpeed")
        try:
            cfg["optimizer"] = _config.optimizer_section(optimizer)
        except InvalidArgumentError as refused:
            # Note [a client optimizer] in strata/engine.py.
            _check_client_optimizer(cfg, source, optimizer, refused)
            client_runs_itself = True
            lr = optimizer.param_groups[0].get("lr", 1e-3) if optimizer.param_groups else 1e-3
            cfg["optimizer"] = {"type": "AdamW", "params": {"lr": float(lr)}}
        hints.lr = cfg["optimizer"]["params"]["lr"]
    if lr_scheduler is not None and not hasattr(lr_scheduler, "step") and not callable(lr_scheduler):
        raise InvalidArgumentError(
            f"initialize: lr_scheduler={type(lr_scheduler).__name__} is neither a scheduler (an "
            "object with step()) nor a callable that takes the optimizer and returns one")
    if lr_scheduler is not None and cfg.get("scheduler"):
        warnings.warn(f"{source}: both the config's \"scheduler\" and lr_scheduler= were given; "
                      "the client scheduler wins, as with DeepSpeed")
    if model_parameters is not None:
        # Read twice below (the check, the groups): generators become lists, groups' too.
        # Frozen parameters among them are left out, as DeepSpeed's optimizer never steps them
        # (model.parameters() with some frozen is the usual call); so is a group left empty.
        groups = []
        for g in model_parameters:
            if isinstance(g, dict):
                if "params" not in g:
                    raise InvalidArgumentError(f"model_parameters: a group without 'params': "
                                               f"{sorted(g)}")
                params = g["params"]
                params = [params] if isinstance(params, torch.Tensor) else list(params)
                kept = [p for p in params if getattr(p, "requires_grad", True)]
                if kept or not params:
                    groups.append(dict(g, params=kept))
            elif getattr(g, "requires_grad", True):
                groups.append(g)
        model_parameters = groups
    _check_model_parameters(model, model_parameters)

    owner = _owner_of(model)
    if owner is not None:
        if owner._user_config == user_cfg and optimizer is None:
            return owner, owner.optimizer, owner._loader_for(training_data, collate_fn), \
                owner.lr_scheduler
        warnings.warn("initialize: this model already has an engine with another config; that "
                      "engine ends (its weights go back to the model) and a new one takes over")
        owner.destroy()
        owner._replaced_by = "initialize was called again on its model with another config"
    _check_parameters_have_memory(model)

    if dist_init_required is not False:
        # As DeepSpeed: torch's default group exists from here on (a world of one without a
        # launcher), so the script's own torch.distributed calls and samplers work.
        _comm.init_distributed()
    port = _comm.engine_rendezvous_port()
    units = _units.default_units(model)
    saved_port = os.environ.get("MASTER_PORT")
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)  # Note [two rendezvous] in strata/comm.py
    shapes = _param_state.shapes_of(model)  # stage 3 empties the parameters it partitions
    # The engine casts floating buffers and frozen parameters to a 16-bit compute dtype, which
    # destroy() undoes.
    found_dtypes = {id(t): t.dtype for t in itertools.chain(
        model.buffers(), (p for p in model.parameters() if not p.requires_grad))}
    try:
        # A PipelineModule's pipeline groups repeat each other's batches (strata/pipe.py).
        engine_cfg = _pipe_engine.engine_config(cfg, model, _comm.get_world_size())
        cpp = _strata.Engine(model, [m for _, m in units], json.dumps(engine_cfg), source, hints,
                             _engine_groups(optimizer, model_parameters, cfg),
                             client_optimizer=client_runs_itself)
    finally:
        if port is not None:
            os.environ["MASTER_PORT"] = saved_port
    engine_class = _pipe_engine.PipelineEngine if isinstance(model, _pipe.PipelineModule) \
        else StrataEngine
    engine = engine_class(cpp, model, units)
    engine._found_dtypes = found_dtypes
    try:
        engine._user_config = user_cfg
        if isinstance(engine, _pipe_engine.PipelineEngine):
            engine.configure_pipeline(user_cfg.get("pipeline"))
        _param_state.attach(engine, shapes)  # ZeRO-3's ds_* attributes (stage 3)
        if engine.fp16_enabled() and engine.device.type == "cpu":
            _cpu_half.enable()  # fp16 operators in fp32, from here on (python/strata/cpu_half.py)
        trainable = [p for p in model.parameters() if p.requires_grad]
        engine.optimizer = StrataOptimizer(engine, _torch_groups(model_parameters, trainable),
                                           client=optimizer)
        engine._client_optimizer = optimizer
        if client_runs_itself:
            engine._attach_client_optimizer(optimizer)
        if lr_scheduler is None:
            engine.lr_scheduler = ConfigSchedule(engine) if cfg.get("scheduler") else None
        else:
            if not hasattr(lr_scheduler, "step"):
                lr_scheduler = lr_scheduler(engine.optimizer)  # DeepSpeed's callable form
                if not hasattr(lr_scheduler, "step"):
                    raise InvalidArgumentError(
                        "initialize: the lr_scheduler callable returned "
                        f"{type(lr_scheduler).__name__}, not a scheduler (an object with step())")
            engine.lr_scheduler = lr_scheduler  # the setter decides whose groups carry the lr
        engine._publish_lr()
        engine.client_lr_scheduler = lr_scheduler
        loader = engine._loader_for(training_data, collate_fn)
    except BaseException:
        # The engine has started, and under stage 3 holds the model's weights: a setup that
        # fails after it (a bad lr_scheduler, optimizer or training_data) gives them back, so
        # that the model is as initialize found it and can be handed to it again.
        engine.destroy()
        raise
    return engine, engine.optimizer, loader, engine.lr_scheduler
