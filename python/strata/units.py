"""Which submodules of a model the engine manages as units, and the hooks that drive them.

A unit is the granularity of materialization: under ZeRO stage 3 a unit's parameters exist in
device memory only while its forward (and, again, its backward) runs. The default split is the
C++ engine's: each child of the root holding trainable parameters, looking through containers
(Sequential, ModuleList, ModuleDict) to their children. Parameters directly on the root form one
more unit (the C++ engine's unit "") that stays gathered; its forward is hooked like the others.

Each unit gets a forward pre-hook (the engine gathers it) and a forward hook (the engine releases
it and hooks the outputs, so that backward gathers the unit again before entering it). The hooks
are removed when the engine closes.
"""

import sys
import threading

import torch

from . import _strata


def default_units(model):
    """The units of `model` in registration order, as (name, module) pairs: the C++ engine's own
    rule (runtime/engine/unit_rule.h), asked through the bindings so there is one copy of it."""
    return [(name, model.get_submodule(name)) for name in _strata.default_units(model)]


def flatten_tensors(value, out=None):
    """Every tensor inside a unit's output: a Tensor, or tuples, lists, dicts of them."""
    if out is None:
        out = []
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            flatten_tensors(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            flatten_tensors(v, out)
    return out


def _running(module):
    """Whether `module`'s forward is running on this thread: a frame of its forward, or a second
    frame of its call (the first is the one running this pre-hook)."""
    calls = 0
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_locals.get("self") is module:
            if frame.f_code.co_name == "forward":
                return True
            if frame.f_code.co_name == "_call_impl":  # torch 2's _wrapped_call_impl calls it
                calls += 1
        frame = frame.f_back
    return calls > 1


class _ThreadState(threading.local):
    def __init__(self):
        super().__init__()
        self.checkpoint_depth = 0  # inside strata.checkpointing.checkpoint's first forward
        self.engine = None  # the StrataEngine whose forward is running


thread_state = _ThreadState()


class UnitHooks:
    """Installs the begin/end hooks on every unit and keeps the stack of units whose forward is
    open, so that a forward that raises can end them (module hooks have no 'finally')."""

    def __init__(self, cpp, units):
        """units: (the C++ engine's index of the unit, module) pairs."""
        self._cpp = cpp
        self.open = []  # units whose forward runs; None for one a GatheredParameters block holds
        self.held = {}  # unit -> how many GatheredParameters blocks hold it (strata/zero.py)
        self._handles = []
        for index, module in units:
            self._handles.append(module.register_forward_pre_hook(self._pre(index)))
            self._handles.append(module.register_forward_hook(self._post(index)))

    def _pre(self, index):
        def hook(module, args):
            checkpointed = thread_state.checkpoint_depth > 0
            if self.held.get(index, 0) > 0 and not torch.is_grad_enabled() and not checkpointed:
                # An evaluation forward inside a GatheredParameters block over this unit: the
                # block keeps it gathered, and nothing is recorded for backward.
                self.open.append(None)
                return
            try:
                self._cpp.begin_unit(index, checkpointed)
            except _strata.StrataError as e:
                # Still open from a forward of the model called directly (not through the
                # engine) that raised: nothing ended it, and that forward is over unless the
                # module's forward is still running (a module calling itself stays refused).
                # End what it left open, then begin.
                if index not in self.open or "runs inside itself" not in str(e) or \
                        _running(module):
                    raise
                self._end_open_through(index)
                self._cpp.begin_unit(index, checkpointed)
            self.open.append(index)

        return hook

    def _post(self, index):
        def hook(module, args, output):
            if self.open.pop() is not None:
                self._cpp.end_unit(index, flatten_tensors(output))

        return hook

    def end_open_units(self):
        """After an exception inside forward: releases what the failed forward gathered."""
        self._end_open_through(None)

    def _end_open_through(self, last):
        """Ends the open units from the innermost out, through `last` (all of them: None)."""
        while self.open:
            index = self.open.pop()
            if index is not None:
                try:
                    self._cpp.end_unit(index, [])
                except Exception:  # noqa: BLE001 - the forward's own error is the one to report
                    pass
            if last is not None and index == last:
                return

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []
