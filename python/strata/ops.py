"""strata.ops: DeepSpeed's optimizer classes (`deepspeed.ops.adam`), as objects initialize reads.

Scripts and accelerate build `DeepSpeedCPUAdam(params, lr=..., adamw_mode=...)` or
`FusedAdam(...)` and pass it to initialize. Strata does not run these objects: it reads their
hyperparameters into the config's "optimizer" section and runs its own SIMD Adam on the
partitioned states (optim/). Outside an engine they step like torch's Adam/AdamW, so code that
uses them on a plain model still trains.
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


__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
