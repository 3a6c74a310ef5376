"""The rank grids of deepspeed.pipe (ProcessTopology and its pipeline forms), as DeepSpeed
numbers them: the last axis varies fastest, so in PipeDataParallelTopology rank r is stage
r // dp, data-parallel group r % dp."""

import collections

from ._strata import InvalidArgumentError


class ProcessTopology:
    """A grid of ranks over named axes (the last axis varies fastest), as DeepSpeed's."""

    def __init__(self, axes, dims):
        if len(axes) != len(dims) or any(int(d) < 1 for d in dims):
            raise InvalidArgumentError(f"ProcessTopology(axes={axes}, dims={dims}): one positive "
                                       "size per axis")
        self.axes = list(axes)
        self.dims = [int(d) for d in dims]
        self.ProcessCoord = collections.namedtuple("ProcessCoord", self.axes)

    def get_dim(self, axis):
        return self.dims[self.axes.index(axis)] if axis in self.axes else 1

    def world_size(self):
        n = 1
        for d in self.dims:
            n *= d
        return n

    def get_coord(self, rank):
        """The rank's coordinate as a namedtuple over the axes (coord.pipe, coord.data)."""
        coord = {}
        for axis, dim in reversed(list(zip(self.axes, self.dims))):
            coord[axis] = rank % dim
            rank //= dim
        return self.ProcessCoord(**coord)

    def get_rank(self, **coord):
        rank = 0
        for axis, dim in zip(self.axes, self.dims):
            rank = rank * dim + int(coord.get(axis, 0))
        return rank


class PipeDataParallelTopology(ProcessTopology):
    def __init__(self, num_pp, num_dp):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    def __init__(self, num_pp, num_mp, num_dp):
        if int(num_mp) != 1:
            raise InvalidArgumentError(f"PipeModelDataParallelTopology(num_mp={num_mp}): Strata "
                                       "has no tensor (model) parallelism; use num_mp=1")
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])
