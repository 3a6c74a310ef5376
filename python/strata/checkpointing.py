"""strata.checkpointing.checkpoint: activation checkpointing that the engine takes part in.

    x = strata.checkpointing.checkpoint(block, x, mask)

Forward runs `function` without keeping its activations; backward runs it again and
differentiates that. Units inside `function` are gathered for the first run and again for the
recomputation (stage 3), and the CPU random-number state is replayed so that dropout draws the
same mask twice. With the config's activation_checkpointing.cpu_checkpointing the saved inputs
wait in the engine's activation stash (the pinned host pool, NVMe behind it) instead of device
memory. Called outside an engine's forward it is plain activation checkpointing.
"""

import warnings

import torch

from .units import thread_state


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function, cpp, *args):
        ctx.function = function
        ctx.cpp = cpp
        ctx.rng_state = torch.get_rng_state()
        tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.tensor_at = tensor_at
        ctx.input_requires_grad = [args[i].requires_grad for i in tensor_at]
        ctx.args = [None if isinstance(a, torch.Tensor) else a for a in args]
        thread_state.checkpoint_depth += 1
        try:
            out = function(*args)
        finally:
            thread_state.checkpoint_depth -= 1
        inputs = [args[i].detach() for i in tensor_at]
        ctx.handle = None
        if cpp is not None and cpp.cpu_checkpointing:
            ctx.handle = cpp.stash_activations(inputs)
        else:
            ctx.save_for_backward(*inputs)
        if isinstance(out, torch.Tensor):
            ctx.single = True
            return out
        if not isinstance(out, tuple) or not all(isinstance(o, torch.Tensor) for o in out):
            raise TypeError("strata.checkpointing.checkpoint: the function must return a tensor "
                            "or a tuple of tensors")
        ctx.single = False
        return out

    @staticmethod
    def backward(ctx, *grads):
        if ctx.handle is not None:
            saved = ctx.cpp.restore_activations(ctx.handle)
            ctx.handle = None
        else:
            saved = ctx.saved_tensors
        args = list(ctx.args)
        inputs = []
        for i, t, rg in zip(ctx.tensor_at, saved, ctx.input_requires_grad):
            d = t.detach().requires_grad_(rg)
            args[i] = d
            inputs.append(d)
        now = torch.get_rng_state()
        torch.set_rng_state(ctx.rng_state)
        try:
            with torch.enable_grad():
                out = ctx.function(*args)
        finally:
            torch.set_rng_state(now)
        outs = (out,) if isinstance(out, torch.Tensor) else out
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = [None] * len(args)
        for i, d in zip(ctx.tensor_at, inputs):
            input_grads[i] = d.grad if d.requires_grad else None
        return (None, None) + tuple(input_grads)


def checkpoint(function, *args):
    """Runs function(*args) with activation checkpointing; returns its output."""
    if not torch.is_grad_enabled():
        return function(*args)
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        warnings.warn("strata.checkpointing.checkpoint: no input requires grad, so the outputs "
                      "will not either and the function's parameters get no gradient")
    engine = thread_state.engine  # the engine whose forward runs this (None: plain PyTorch)
    return _Checkpoint.apply(function, engine._cpp if engine is not None else None, *args)
