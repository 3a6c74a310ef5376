"""The config a Python script hands to strata.initialize: a dict or a path to DeepSpeed JSON.

The C++ parser validates it (runtime/config.h: unknown keys name the closest valid one, bad
values name the range). This file only gathers the inputs: the file or dict, and an optimizer
passed as an object, which becomes the config's "optimizer" section.
"""

import json
import os

import torch

from ._strata import InvalidArgumentError


def load(config):
    """Returns (dict, source) for a dict, a path, or None."""
    if config is None:
        return {}, "<no config>"
    if isinstance(config, dict):
        return json.loads(json.dumps(config)), "<dict>"
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise InvalidArgumentError(f"config {path}: {e.strerror}; pass a path to a DeepSpeed "
                                       "JSON file or a dict") from None
        try:
            return json.loads(text), path
        except json.JSONDecodeError as e:
            raise InvalidArgumentError(f"config {path}: not JSON ({e})") from None
    raise InvalidArgumentError(f"config must be a dict or a path to a JSON file, not "
                               f"{type(config).__name__}")


def _group_hyperparameters(group):
    return (float(group["lr"]), tuple(float(b) for b in group["betas"]), float(group["eps"]),
            float(group["weight_decay"]))


def optimizer_section(optimizer):
    """The config "optimizer" section equal to a torch.optim.Adam / AdamW the script built, or
    an error naming what cannot be carried over."""
    if isinstance(optimizer, torch.optim.AdamW):
        kind = "AdamW"
    elif isinstance(optimizer, torch.optim.Adam):
        kind = "Adam"
    else:
        raise InvalidArgumentError(
            f"optimizer={type(optimizer).__name__}: Strata runs its own Adam/AdamW on the "
            "partitioned states; pass torch.optim.Adam or AdamW, or leave optimizer=None and set "
            "the config's \"optimizer\" section")
    groups = optimizer.param_groups
    first = _group_hyperparameters(groups[0])
    for g in groups[1:]:
        if _group_hyperparameters(g) != first:
            raise InvalidArgumentError(
                "optimizer has parameter groups with different lr, betas, eps or weight_decay; "
                "Strata applies one set to every parameter: use one group")
    for g in groups:
        if g.get("amsgrad") or g.get("maximize"):
            raise InvalidArgumentError("optimizer uses amsgrad or maximize, which Strata's Adam "
                                       "does not implement; turn them off")
    lr, betas, eps, weight_decay = first
    return {"type": kind,
            "params": {"lr": lr, "betas": list(betas), "eps": eps, "weight_decay": weight_decay}}
