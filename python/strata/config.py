"""The config a Python script hands to strata.initialize: a dict or a path to DeepSpeed JSON.

The C++ parser validates it (runtime/base/config.h: unknown keys name the closest valid one, bad
values name the range). This file only gathers the inputs: the file or dict, and an optimizer
passed as an object, which becomes the config's "optimizer" section.

Files are read as DeepSpeed reads them (it uses hjson): comments (`//`, `#`, `/* */`) and
trailing commas are accepted. Hjson's other forms (unquoted strings, keys without quotes,
multi-line strings) are not: such a file gets an error naming the line, with the fix.
"""

import json
import math
import os
import time

import torch

from ._strata import InvalidArgumentError


def load(config):
    """Returns (dict, source) for a dict, a path, or None."""
    cfg, source = _read(config)
    return _finite(cfg, source, ""), source


# What steps_per_print = inf means: never. accelerate writes exactly that into every config it
# hands to initialize (so that DeepSpeed's `steps % inf` never hits zero); the engine's config
# takes a whole number, and JSON has no infinity, so "never" becomes the largest step it takes.
_NEVER = 2**63 - 1


def _finite(value, source, path):
    """`value` with the one infinity DeepSpeed gives a meaning replaced; any other inf or nan is
    refused by its key path (JSON cannot carry it, and no setting means anything by it)."""
    if isinstance(value, dict):
        return {k: _finite(v, source, f"{path}.{k}" if path else k) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v, source, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        if path == "steps_per_print" and value > 0:
            return _NEVER
        raise InvalidArgumentError(f"{source}: {path} is {value}; give a finite number")
    return value


def _read(config):
    if config is None:
        return {}, "<no config>"
    if isinstance(config, dict):
        return json.loads(json.dumps(config)), "<dict>"
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        # Scripts launched on several ranks often have every rank write the config to one path
        # just before initialize (DeepSpeed's own test scripts write /tmp/temp_config.json):
        # a rank may read it while another rewrites it, empty or cut short. Such a file is read
        # again for about a second before it is refused; a whole one parses the first time.
        for attempt in range(6):
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except OSError as e:
                raise InvalidArgumentError(f"config {path}: {e.strerror}; pass a path to a "
                                           "DeepSpeed JSON file or a dict") from None
            try:
                return json.loads(relaxed_json(text), object_pairs_hook=_no_duplicate_keys), path
            except json.JSONDecodeError as e:
                if attempt < 5:
                    time.sleep(0.2)
                    continue
                raise InvalidArgumentError(
                    f"config {path}: not JSON ({e}); write it as JSON (comments and trailing "
                    "commas are accepted)") from None
            except ValueError as e:
                raise InvalidArgumentError(f"config {path}: {e}") from None
    raise InvalidArgumentError(f"config must be a dict or a path to a JSON file, not "
                               f"{type(config).__name__}")


def _no_duplicate_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice in one object; keep one")
        out[k] = v
    return out


def relaxed_json(text):
    """`text` with comments and trailing commas removed, everything inside strings kept, so that
    json.loads reads what hjson reads for a JSON-shaped file. Line breaks stay, so error
    positions still name the right line."""
    out = []
    i, n = 0, len(text)
    pending_comma = None  # index in `out` of a comma that may turn out to be trailing
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            pending_comma = None
            i = j + 1
        elif c == "#" or text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            skipped = text[i:n if j < 0 else j + 2]
            out.append("\n" * skipped.count("\n"))
            i = n if j < 0 else j + 2
        elif c == ",":
            pending_comma = len(out)
            out.append(c)
            i += 1
        elif c in "}]":
            if pending_comma is not None:
                out[pending_comma] = ""
            pending_comma = None
            out.append(c)
            i += 1
        else:
            if not c.isspace():
                pending_comma = None
            out.append(c)
            i += 1
    return "".join(out)


def _group_hyperparameters(group):
    return (float(group["lr"]), tuple(float(b) for b in group["betas"]), float(group["eps"]),
            float(group["weight_decay"]))


def group_hyperparameters(group, defaults):
    """(lr, beta1, beta2, eps, weight_decay) of one parameter group, `defaults` (the effective
    config's optimizer params) filling what the group does not set. A value that is not a
    number (or betas that are not two) is refused naming the group's key."""
    def number(key, fallback):
        v = group.get(key, defaults.get(key, fallback))
        try:
            return float(v)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"parameter group {key}={v!r}: must be a number") from None
    betas = group.get("betas", defaults.get("betas", (0.9, 0.999)))
    try:
        b1, b2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"parameter group betas={betas!r}: must be two numbers, "
                                   "e.g. (0.9, 0.999)") from None
    return [number("lr", 1e-3), b1, b2, number("eps", 1e-8), number("weight_decay", 0.0),
            number("momentum", 0.0), number("dampening", 0.0)]


def _sgd_section(optimizer):
    g = optimizer.param_groups[0]
    if any(grp.get("maximize") for grp in optimizer.param_groups):
        raise InvalidArgumentError("optimizer SGD uses maximize, which Strata's SGD does not "
                                   "implement; turn it off")
    if len({bool(grp.get("nesterov")) for grp in optimizer.param_groups}) > 1:
        raise InvalidArgumentError("optimizer SGD: nesterov differs between groups; Strata takes "
                                   "one nesterov setting for every group")
    return {"type": "SGD", "params": {"lr": float(g["lr"]), "momentum": float(g["momentum"]),
                                      "dampening": float(g["dampening"]),
                                      "weight_decay": float(g["weight_decay"]),
                                      "nesterov": bool(g["nesterov"])}}


def _adagrad_section(optimizer):
    groups = optimizer.param_groups
    g = groups[0]
    if any(grp.get("maximize") for grp in groups):
        raise InvalidArgumentError("optimizer Adagrad uses maximize, which Strata's Adagrad does "
                                   "not implement; turn it off")
    if any(float(grp.get("initial_accumulator_value", 0.0)) != 0.0 for grp in groups):
        raise InvalidArgumentError("optimizer Adagrad: initial_accumulator_value must be 0 (the "
                                   "sum starts at zero in Strata's Adagrad, torch's default)")
    if len({float(grp.get("lr_decay", 0.0)) for grp in groups}) > 1:
        raise InvalidArgumentError("optimizer Adagrad: lr_decay differs between groups; Strata "
                                   "takes one lr_decay for every group")
    return {"type": "Adagrad", "params": {"lr": float(g["lr"]),
                                          "lr_decay": float(g.get("lr_decay", 0.0)),
                                          "eps": float(g["eps"]),
                                          "weight_decay": float(g["weight_decay"])}}


def _lion_section(optimizer):
    g = optimizer.param_groups[0]
    return {"type": "Lion", "params": {"lr": float(g["lr"]), "betas": [float(b) for b in g["betas"]],
                                       "weight_decay": float(g["weight_decay"])}}


def optimizer_section(optimizer):
    """The config "optimizer" section equal to a torch.optim.Adam / AdamW / SGD / Adagrad (or a
    strata.ops / deepspeed.ops optimizer) the script built, or an error naming what cannot be
    carried over."""
    from . import ops  # late: ops imports nothing from here, but keeps config importable alone
    if isinstance(optimizer, torch.optim.SGD):
        return _sgd_section(optimizer)
    if isinstance(optimizer, torch.optim.Adagrad):
        return _adagrad_section(optimizer)
    if isinstance(optimizer, ops._LionFamily):
        return _lion_section(optimizer)
    if isinstance(optimizer, torch.optim.AdamW):
        # DeepSpeedCPUAdam / FusedAdam (strata.ops) are AdamW with an adam_w_mode switch.
        kind = "AdamW" if getattr(optimizer, "adam_w_mode", True) else "Adam"
    elif isinstance(optimizer, torch.optim.Adam):
        kind = "Adam"
    else:
        raise InvalidArgumentError(
            f"optimizer={type(optimizer).__name__}: Strata runs its own Adam, AdamW, SGD, Adagrad "
            "and Lion on the partitioned states; pass torch.optim.Adam, AdamW, SGD or Adagrad (or "
            "deepspeed.ops' DeepSpeedCPUAdam, FusedAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion, "
            "FusedLion), or leave optimizer=None and set the config's \"optimizer\" section")
    groups = optimizer.param_groups
    # Group 0's values stand for the section; each group keeps its own (initialize passes them
    # to the engine as parameter groups).
    first = _group_hyperparameters(groups[0])
    for g in groups:
        if g.get("amsgrad") or g.get("maximize"):
            raise InvalidArgumentError("optimizer uses amsgrad or maximize, which Strata's Adam "
                                       "does not implement; turn them off")
    lr, betas, eps, weight_decay = first
    params = {"lr": lr, "betas": list(betas), "eps": eps, "weight_decay": weight_decay}
    if kind == "Adam":
        # A config's "Adam" means decoupled decay, as in DeepSpeed (Note [Adam means AdamW] in
        # runtime/base/config.cc); torch's Adam adds the decay to the gradient.
        params["adam_w_mode"] = False
    return {"type": kind, "params": params}
