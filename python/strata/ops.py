"""strata.ops: DeepSpeed's optimizer classes (`deepspeed.ops.adam`, `.adagrad`, `.lion`), as
objects initialize reads.

Scripts and accelerate build `DeepSpeedCPUAdam(params, lr=..., adamw_mode=...)`, `FusedAdam(...)`,
`DeepSpeedCPUAdagrad(...)`, `DeepSpeedCPULion(...)` or `FusedLion(...)` and pass it to initialize.
Strata does not run these objects: it reads their hyperparameters into the config's "optimizer"
section and runs its own SIMD optimizer on the partitioned states (optim/). Outside an engine
they step like the optimizer they name (torch's Adam/AdamW/Adagrad; Lion written out below), so
code that uses them on a plain model still trains.
"""

import torch


class _AdamFamily(torch.optim.AdamW):
    """torch.optim.AdamW with DeepSpeed's adam_w_mode switch: False is Adam with L2 decay (the
    decay term added to the gradient), True decoupled decay."""

    def __init__(self, params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
                 adam_w_mode):
        if not bias_correction:
            raise ValueError(f"{type(self).__name__}(bias_correction=False): Strata's Adam always "
                             "applies bias correction; leave it True")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad)
        self.adam_w_mode = bool(adam_w_mode)

    @torch.no_grad()
    def step(self, closure=None):
        if self.adam_w_mode:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        decays = []
        for group in self.param_groups:
            decays.append(group["weight_decay"])
            for p in group["params"]:
                if p.grad is not None and group["weight_decay"] != 0:
                    p.grad.add_(p, alpha=group["weight_decay"])
            group["weight_decay"] = 0.0
        try:
            super().step()
        finally:
            for group, wd in zip(self.param_groups, decays):
                group["weight_decay"] = wd
        return loss


class DeepSpeedCPUAdam(_AdamFamily):
    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        super().__init__(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
                         adamw_mode)
        self.fp32_optimizer_states = fp32_optimizer_states


class FusedAdam(_AdamFamily):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True):
        super().__init__(params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
                         adam_w_mode)


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's CPU Adagrad signature over torch's Adagrad (no lr_decay, sum starting at 0)."""

    def __init__(self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False,
                 fp32_optimizer_states=True):
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad(amsgrad=True): Adagrad has no AMSGrad variant; "
                             "leave it False")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
        self.fp32_optimizer_states = fp32_optimizer_states


class _LionFamily(torch.optim.Optimizer):
    """Lion (Chen et al. 2023) on plain tensors, as Strata's CPU and GPU kernels compute it:
    c = beta1*m + (1-beta1)*g; p *= 1 - lr*wd; p -= lr*sign(c); m = beta2*m + (1-beta2)*g."""

    def __init__(self, params, lr, betas, weight_decay):
        if not 0.0 <= lr:
            raise ValueError(f"{type(self).__name__}(lr={lr}): must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"{type(self).__name__}(betas={tuple(betas)}): both must be in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                m = state["exp_avg"]
                g = p.grad.float()
                c = m.mul(beta1).add_(g, alpha=1 - beta1)
                if group["weight_decay"] != 0:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(c.sign_().to(p.dtype), alpha=-group["lr"])
                m.mul_(beta2).add_(g, alpha=1 - beta2)
        return loss


class DeepSpeedCPULion(_LionFamily):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0,
                 fp32_optimizer_states=True):
        super().__init__(params, lr, betas, weight_decay)
        self.fp32_optimizer_states = fp32_optimizer_states


class FusedLion(_LionFamily):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, set_grad_none=True):
        super().__init__(params, lr, betas, weight_decay)


__all__ = ["DeepSpeedCPUAdam", "FusedAdam", "DeepSpeedCPUAdagrad", "DeepSpeedCPULion", "FusedLion"]
