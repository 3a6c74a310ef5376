"""The optimizer and the config's schedule as initialize returns them.

StrataOptimizer is a real torch.optim.Optimizer: torch's LR schedulers and Hugging Face's Trainer
wrap its step and write its param_groups. The optimizer states themselves live in the engine's
tiers; what lives here is the hyperparameters, and the engine reads the lr from these groups at every
step (StrataEngine._sync_lr), so a client scheduler, a scheduler built on the client's own torch
optimizer, or a loop that writes the lr by hand all drive the update.

When initialize got a torch optimizer, StrataOptimizer shares that optimizer's param_groups (the
same list of the same dicts): a scheduler the script built on its own optimizer moves Strata's lr
too, as it moves DeepSpeed's, which updates through the client optimizer's groups.
"""

from collections import defaultdict

import torch

from ._strata import InvalidArgumentError
from .config import group_hyperparameters


class StrataOptimizer(torch.optim.Optimizer):
    """The engine's optimizer (Adam/AdamW/SGD/Adagrad/Lion) seen as a torch optimizer:
    param_groups to read and write, step, zero_grad, state_dict. Its per-parameter `state` stays
    empty: the optimizer states (moments, momentum buffers, Adagrad's sums) are partitioned
    across ranks and tiers and go into engine.save_checkpoint, not into state_dict()."""

    def __init__(self, engine, params, client=None):
        section = engine.config.get("optimizer", {})
        given = section.get("params", {})
        lr, beta1, beta2, eps, weight_decay, momentum, dampening = group_hyperparameters({}, given)
        kind = section.get("type")
        if kind == "SGD":
            defaults = {"lr": lr, "momentum": momentum, "dampening": dampening,
                        "weight_decay": weight_decay, "nesterov": bool(given.get("nesterov", False))}
        elif kind == "Adagrad":
            defaults = {"lr": lr, "lr_decay": float(given.get("lr_decay", 0.0)), "eps": eps,
                        "weight_decay": weight_decay, "initial_accumulator_value": 0.0}
        elif kind == "Lion":
            defaults = {"lr": lr, "betas": (beta1, beta2), "weight_decay": weight_decay}
        else:
            defaults = {"lr": lr, "betas": (beta1, beta2), "eps": eps, "weight_decay": weight_decay}
        super().__init__(list(params), defaults)
        if client is not None:
            self.param_groups = client.param_groups
            self.defaults = client.defaults
        self.state = defaultdict(dict)
        self._engine = engine

    # torch's schedulers patch `step` on the instance: keep it a plain method.
    def step(self, closure=None):
        if closure is not None:
            raise InvalidArgumentError("optimizer.step(closure): closures are not supported "
                                       "(the engine runs backward itself: engine.backward(loss))")
        self._engine.step()

    def zero_grad(self, set_to_none=True):
        """Nothing to clear: the engine moves gradients out of .grad as they are computed."""

    @property
    def overflow(self):
        """Whether the last step was skipped for an fp16 overflow (DeepSpeed's attribute)."""
        return not self._engine.was_step_applied() and self._engine.last_report is not None

    @property
    def cur_scale(self):
        """The dynamic loss scale the next backward multiplies the loss by (fp16; 1 otherwise),
        DeepSpeed's FP16_Optimizer attribute."""
        return self._engine._cpp.loss_scale

    @property
    def loss_scale(self):
        """The same scale, under the name DeepSpeed's optimizers also give it."""
        return self._engine._cpp.loss_scale

    def state_dict(self):
        """The groups' hyperparameters (lr, betas, eps, weight_decay and whatever a scheduler
        added, such as initial_lr), with parameters as indices, as torch writes them. The Adam
        moments are not here: engine.save_checkpoint holds them."""
        groups, index = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(packed)
        return {"state": {}, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Restores the hyperparameters state_dict() saved, in place (a client optimizer sharing
        these groups sees them too). Per-parameter state is refused: the moments come back with
        engine.load_checkpoint."""
        if not isinstance(state_dict, dict) or "param_groups" not in state_dict:
            raise InvalidArgumentError("optimizer.load_state_dict: expected a dict with "
                                       "'param_groups', as optimizer.state_dict() returns")
        if state_dict.get("state"):
            raise InvalidArgumentError(
                "optimizer.load_state_dict: this state_dict holds per-parameter state (Adam "
                "moments from a plain torch optimizer?); Strata's moments are partitioned and "
                "come back with engine.load_checkpoint, so only the hyperparameters load here")
        saved = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in self.param_groups]
        if len(saved) != len(self.param_groups) or [len(g["params"]) for g in saved] != sizes:
            raise InvalidArgumentError(
                f"optimizer.load_state_dict: {len(saved)} group(s) of sizes "
                f"{[len(g['params']) for g in saved]} do not match this optimizer's {sizes}")
        for mine, theirs in zip(self.param_groups, saved):
            for key, value in theirs.items():
                if key != "params":
                    mine[key] = value


class ConfigSchedule:
    """The config's "scheduler" (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest).
    The engine writes its lr (and OneCycle's cycled betas) into the optimizer's groups after each
    step, as DeepSpeed's schedulers do, so a loop that writes them between steps overrides them
    for that step only."""

    def __init__(self, engine):
        self._engine = engine
        # Each group's lr before the schedule wrote any: WarmupCosineLR scales each group's own,
        # as DeepSpeed's does (the others write one lr into every group).
        engine._schedule_base_lrs = [g["lr"] for g in engine.optimizer.param_groups]

    @property
    def optimizer(self):
        return self._engine.optimizer

    def step(self, *args, **kwargs):
        """Writes the schedule's values for the next step into the groups. The engine does this
        itself after each step; a scheduler that wraps this one (VariableBatchSizeLR) calls it."""
        self._engine._write_config_schedule()

    def get_last_lr(self):
        return self._engine.get_lr()

    def get_lr(self):
        return self._engine.get_lr()

    def state_dict(self):
        return {"global_steps": self._engine.global_steps}

    def load_state_dict(self, state_dict):
        """The schedule is a function of the step count, which engine.load_checkpoint restores;
        this checks that the two agree."""
        steps = state_dict.get("global_steps") if isinstance(state_dict, dict) else None
        if steps is not None and steps != self._engine.global_steps:
            raise InvalidArgumentError(
                f"lr_scheduler.load_state_dict: saved at step {steps} but the engine is at step "
                f"{self._engine.global_steps}; load the engine's checkpoint of that step first")
