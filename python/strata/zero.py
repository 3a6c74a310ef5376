"""strata.zero: DeepSpeed's zero.Init and zero.GatheredParameters."""

import torch

from . import engine as _engine
from ._strata import InvalidArgumentError


class GatheredParameters:
    """Makes the given parameters readable inside the block (ZeRO stage 3 keeps a unit's
    parameters empty outside its forward and backward):

        with strata.zero.GatheredParameters(model.head.weight):
            print(model.head.weight.norm())

    Reading only: changes made inside the block are not written back to the partitions, so
    modifier_rank must stay None. Outside an engine, or below stage 3, it does nothing."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self._params = list(params) if params is not None else []
        self._enabled = enabled
        self._open = []
        self._engine = None
        if modifier_rank is not None and enabled:
            raise InvalidArgumentError(
                "GatheredParameters(modifier_rank=...): writing gathered parameters back into the "
                "partitions is not supported; initialize parameters before strata.initialize")

    def __enter__(self):
        if not self._enabled:
            return self
        units = set()
        for p in self._params:
            for engine in _engine._live_engines.values():
                found = engine._units_of_param(p)
                if found is not None:
                    self._engine = engine
                    units.update(found)
                    break
        if self._engine is None or self._engine.zero_optimization_stage() < 3:
            return self
        with torch.no_grad():
            try:
                for u in sorted(units):
                    self._engine._cpp.begin_unit(u, False)
                    self._open.append(u)
            except BaseException:
                self.__exit__(None, None, None)
                raise
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            while self._open:
                self._engine._cpp.end_unit(self._open.pop(), [])
        return False
