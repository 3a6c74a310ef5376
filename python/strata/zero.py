"""strata.zero: DeepSpeed's zero.Init and zero.GatheredParameters."""

import functools
import os
import re

import torch

from . import engine as _engine
from . import param_state as _param_state
from ._strata import InvalidArgumentError
from ._strata import ZeroInit as _ZeroInit


class GatheredParameters:
    """Makes the given parameters readable inside the block (ZeRO stage 3 keeps a unit's
    parameters empty outside its forward and backward), and with `modifier_rank` writable:

        with strata.zero.GatheredParameters(model.head.weight):
            print(model.head.weight.norm())
        with strata.zero.GatheredParameters(model.embed.weight, modifier_rank=0):
            if rank == 0:
                model.embed.weight[3] = 0.0

    modifier_rank=r: on leaving the block, rank r's values are broadcast to every rank and written
    into the partitions (the fp32 master and the working copy, NVMe-resident ones included);
    optimizer states are untouched. Every rank must enter the block. Without it, changes reach no
    partition: a unit the block gathered drops them as it is released, and a parameter that stays
    gathered (stages 0-2, or under stage3_param_persistence_threshold) keeps them in its working
    copy until the next step writes the master's values over it, as in DeepSpeed. Write into the
    parameter (p[...] = ..., p.copy_(...)); a block that replaces p.data (another dtype, shape or
    tensor) is refused on leaving and the parameter keeps its own tensor. Outside an engine, the
    broadcast alone runs (the parameters are plain tensors)."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        if isinstance(params, torch.Tensor):
            params = [params]
        if isinstance(params, (str, bytes)):
            raise InvalidArgumentError(f"GatheredParameters({params!r:.40}): pass a parameter or an "
                                       "iterable of parameters (such as module.parameters())")
        self._params = list(params) if params is not None else []
        for p in self._params:
            if not isinstance(p, torch.Tensor):
                raise InvalidArgumentError(
                    f"GatheredParameters: a {type(p).__name__} ({p!r:.40}) among the parameters; "
                    "pass parameters (torch.nn.Parameter) only")
        self._enabled = enabled
        self._open = []
        self._engine = None
        if modifier_rank is not None and (not isinstance(modifier_rank, int) or modifier_rank < 0):
            raise InvalidArgumentError(f"GatheredParameters(modifier_rank={modifier_rank!r}): a "
                                       "rank (an int >= 0) or None")
        self._modifier_rank = modifier_rank

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
            else:
                # No engine holds it and it has no values: the block would show an empty tensor
                # (and a forward in it fail on its shape) with no word of why.
                if _param_state.emptied_by_a_closed_engine(p):
                    raise InvalidArgumentError(
                        f"GatheredParameters: a parameter of shape {tuple(p.ds_shape)} has no "
                        "values to gather: its ZeRO-3 engine was closed, and close() leaves the "
                        "parameters empty; call engine.destroy() instead (it gives the model its "
                        "weights back), or load a checkpoint into a new engine")
        if self._modifier_rank is not None:
            world = self._engine.world_size if self._engine is not None else _world_size()
            if self._modifier_rank >= world:
                raise InvalidArgumentError(
                    f"GatheredParameters(modifier_rank={self._modifier_rank}): the world has "
                    f"{world} rank(s)")
        self._fill_scratch()
        if self._engine is None or self._engine.zero_optimization_stage() < 3:
            self._remember_tensors()
            return self
        # A unit already gathered by an enclosing block, or whose forward is running (a model
        # that gathers its own weights inside forward), is not begun again: the outermost holder
        # keeps it until it ends.
        held = self._engine._hooks.held
        with torch.no_grad():
            try:
                for u in sorted(units):
                    if held.get(u, 0) == 0 and u not in self._engine._hooks.open:
                        self._engine._cpp.begin_unit(u, False)
                        self._open.append((u, True))
                    else:
                        self._open.append((u, False))
                    held[u] = held.get(u, 0) + 1
            except BaseException:
                self.__exit__(None, None, None)
                raise
        self._remember_tensors()
        return self

    def _remember_tensors(self):
        """Each engine parameter's tensor as the block starts (gathered), to find one the block
        replaces (_keep_own_tensors)."""
        engine = self._engine
        self._tensors = [(p, p.data) for p in self._params
                         if engine is not None and engine._units_of_param(p) is not None]

    def __exit__(self, exc_type, *exc):
        try:
            self._keep_own_tensors(refuse=exc_type is None)
            if self._enabled and self._modifier_rank is not None and exc_type is None:
                self._write_back()
        finally:
            with torch.no_grad():
                while self._open:
                    u, began = self._open.pop()
                    self._engine._hooks.held[u] -= 1
                    if began:
                        self._engine._cpp.end_unit(u, [])
        return False

    def _keep_own_tensors(self, refuse):
        """An engine's parameter is a view of its chunk, of the engine's dtype and shape: `p.data =
        other` inside the block would leave it outside the chunk, where no write-back reaches and
        every later forward meets the other dtype or shape. Such parameters get their own tensor
        back, and the block is refused naming the first (unless it is raising already: its own
        error is the one to see)."""
        replaced = [(p, own) for p, own in getattr(self, "_tensors", [])
                    if p.data.data_ptr() != own.data_ptr() or p.data.dtype != own.dtype
                    or p.data.shape != own.shape]
        self._tensors = []
        if not replaced:
            return
        with torch.no_grad():
            for p, own in replaced:
                p.data = own
        if not refuse:
            return
        p, own = replaced[0]
        raise InvalidArgumentError(
            f"GatheredParameters: {len(replaced)} parameter(s) had their tensor replaced inside "
            f"the block (p.data = ...), the first from {own.dtype} {tuple(own.shape)}; the "
            "engine's parameters are views of its memory, so they keep their own tensors: write "
            "into them instead (p.copy_(new), p[...] = ...), with modifier_rank set")

    def _fill_scratch(self):
        """A zero.Init's parameters on ranks > 0 are scratch until an engine has them (Init's
        docstring). A block that reads them (modifier_rank=None) or keeps another rank's writes
        (modifier_rank > 0) first gives them rank 0's values, in memory of their own, which they
        keep until the engine's start. modifier_rank=0 needs nothing: only rank 0's writes count,
        and the engine's start gives them to every rank."""
        if self._modifier_rank == 0 or _world_size() == 1:
            return
        rank = torch.distributed.get_rank()
        with torch.no_grad():
            for p in self._params:
                if p.numel() == 0 or not _scratch(p):
                    continue
                if rank > 0:
                    p.data = torch.empty_like(p.data, memory_format=torch.contiguous_format)
                _broadcast(p.data, 0)

    def _write_back(self):
        params = [p for p in self._params if p.numel() > 0]
        with torch.no_grad():
            if _world_size() > 1:
                for p in params:
                    # Built under a zero.Init of several ranks and not yet an engine's: the
                    # engine's start takes rank 0's values on every rank, and the other ranks
                    # hold scratch memory (Init's docstring), so a broadcast now would move the
                    # model for nothing. Every rank built the same parameters, so every rank
                    # skips the same ones.
                    if self._modifier_rank == 0 and _scratch(p):
                        continue
                    _broadcast(p.data, self._modifier_rank)
            if self._engine is not None:
                self._engine._cpp.write_params(
                    [p for p in params if self._engine._units_of_param(p) is not None])


def _world_size():
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _broadcast(t, src):
    """torch.distributed.broadcast of `t` from `src`. A host tensor (a parameter not yet an
    engine's) goes through the GPU where the group is NCCL's, which moves only device memory."""
    dist = torch.distributed
    if t.device.type == "cpu" and dist.get_backend() == "nccl":
        staged = t.to(f"cuda:{torch.cuda.current_device()}")
        dist.broadcast(staged, src=src)
        t.copy_(staged)
    else:
        dist.broadcast(t, src=src)


def _rank_and_world():
    """This process's rank and the world's size. A launcher's world of several ranks gets its
    process group here, as DeepSpeed's zero.Init sets it up (comm.init_distributed; strata.initialize
    later finds it made)."""
    from . import comm as _comm

    if os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
        _comm.init_distributed()
    return _comm.get_rank(), _comm.get_world_size()


def _scratch(p):
    """Whether `p` is a zero.Init parameter of several ranks that no engine has taken yet:
    scratch memory on ranks > 0, rank 0's values on rank 0 (Init's docstring). The engine clears
    the mark when it takes the model."""
    return getattr(p, "_strata_rank0_values", False)


class Init:
    """Builds a model larger than DRAM straight into a staging file:

        with strata.zero.Init(config_dict_or_path=ds_config):
            model = MyModel()
        engine, *_ = strata.initialize(model=model, config=ds_config)

    As each module finishes its constructor, its trainable parameters are written to a staging
    file and become shared mappings of it (runtime/engine/zero_init.h, StageMapped): their pages are
    file-backed, so the kernel can write them back and reclaim them, and the process's anonymous
    memory holds about one module at a time. Parameters stay readable and writable, so the
    initialization passes models run at the end of their constructor (torchvision's kaiming init,
    Hugging Face's post_init) work unchanged. strata.initialize then reads them into the tiers.

    The staging directory is `nvme_path`, else the first directory of the config's NVMe tier
    (offload_optimizer's nvme_path when it offloads to nvme, else offload_param's likewise: the
    disk whose space the engine's start gets back as it writes its blocks), else either
    section's nvme_path, else the system's temporary directory; where that is kept in
    memory (tmpfs: Debian 13's /tmp) and TMPDIR does not name it, /var/tmp. A directory in memory
    would hold the model in DRAM, so one given there is warned about. The file is unlinked at
    once, so nothing is left behind by a crash.

    On several ranks only rank 0 stages: the engine's start gives every rank rank 0's values, so
    the others' are never read. Their parameters keep their shapes and stay writable (the model's
    own initialization code runs on every rank unchanged), but all of them share one 32 MiB
    scratch region of memory, so those ranks hold neither the model nor a file of it (Note
    [scratch parameters] in runtime/engine/zero_init.cc). Their values are meaningless until
    strata.initialize; under DeepSpeed they would be empty partitions there. Tools that show RSS
    count the region once per 32 MiB of parameters written; the memory used (PSS, the cgroup's
    charge) is the region's. GatheredParameters(modifier_rank=0) on such parameters, before the
    engine has them, broadcasts nothing: rank 0's writes reach every rank at the engine's start.
    So a parameter built here that no engine takes (a reference copy kept outside the model the
    engine trains) keeps meaningless values on ranks > 0 even after such a block; give it
    modifier_rank=None's or another rank's block to read rank 0's values there.

    The parameters' dtype (`dtype`, DeepSpeed's argument): torch.float32, torch.bfloat16 or
    torch.float16. Unset, it is torch.bfloat16 for a config with
    bf16.bf16_master_weights_and_grads (the engine keeps only bf16 bits then, so fp32 would double
    the staging file for nothing) and torch.float32 otherwise. DeepSpeed builds in the config's
    bf16/fp16 dtype always; Strata keeps fp32 where the engine keeps an fp32 master, so that
    master starts from the exact fp32 values. A 16-bit parameter is cast as its module's
    constructor returns, so an initialization inside that constructor is fp32 rounded to nearest;
    one that runs later (a parent's constructor, a post_init) runs on the 16-bit tensor, as it does
    under DeepSpeed."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
                 enabled=True, dtype=None, mpu=None, nvme_path=None):
        from . import config as _config

        if module is not None:
            raise InvalidArgumentError("zero.Init(module=...): converting an existing model is "
                                       "not supported; build the model inside the with block")
        if dtype is not None and dtype not in _INIT_DTYPES:
            raise InvalidArgumentError(
                f"zero.Init(dtype={dtype!r}): parameters are built as torch.float32, "
                "torch.bfloat16 or torch.float16 (DeepSpeed's choices); leave dtype unset for the "
                "config's")
        # The config is read only for what it decides: the dtype, and the staging directory.
        cfg = {}
        if enabled and (dtype is None or nvme_path is None):
            cfg, _ = _config.load(config_dict_or_path if config_dict_or_path is not None else config)
        self.dtype = dtype if dtype is not None else _default_dtype(cfg)
        self._enabled = enabled
        self._dir = nvme_path
        if self._dir is None:
            self._dir = _staging_dir_of(cfg.get("zero_optimization", {}))
        if self._dir is None:
            self._dir = _default_staging_dir()
        self._cpp = None
        self._several_ranks = False  # set by __enter__: parameters are then marked rank 0's
        self._patched = []
        self._staged = set()
        self.staged_bytes = 0
        self.staged_params = 0

    def __enter__(self):
        global _active_init
        if not self._enabled:
            return self
        if _active_init is not None:
            raise InvalidArgumentError("zero.Init blocks do not nest")
        rank, world = _rank_and_world()
        self._several_ranks = world > 1
        if rank == 0 and _memory_backed(self._dir):  # the other ranks stage nothing
            import warnings

            warnings.warn(f"zero.Init: the staging directory {self._dir} is kept in memory "
                          "(tmpfs), so the model built there stays in DRAM; give nvme_path (or "
                          "the config's offload nvme_path, or TMPDIR) a directory on a disk",
                          stacklevel=2)
        self._cpp = _ZeroInit(os.fspath(self._dir), shapes_only=rank > 0)
        _active_init = self
        for cls in _module_classes():
            self._wrap(cls)
        # Classes defined inside the block get wrapped as they are created.
        self._orig_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")
        init = self

        def init_subclass(cls, **kwargs):
            if init._orig_init_subclass is not None:
                init._orig_init_subclass.__func__(cls, **kwargs)
            else:
                super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            init._wrap(cls)

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)
        return self

    def __exit__(self, *exc):
        global _active_init
        if not self._enabled or self._cpp is None:
            return False
        if self._orig_init_subclass is not None:
            torch.nn.Module.__init_subclass__ = self._orig_init_subclass
        else:
            del torch.nn.Module.__init_subclass__
        for cls, original in reversed(self._patched):
            cls.__init__ = original
        self._patched = []
        self.staged_bytes = self._cpp.staged_bytes
        self.staged_params = self._cpp.staged_params
        # Closing the file leaves the mappings (and so the parameters) valid.
        self._cpp = None
        _active_init = None
        return False

    def _wrap(self, cls):
        original = cls.__dict__.get("__init__")
        if original is None or getattr(original, "_strata_original", None) is not None:
            return
        init = self

        @functools.wraps(original)
        def wrapped(module, *args, **kwargs):
            # Stage once, when the object's outermost constructor (its most derived class's)
            # returns: a subclass may still write parameters after super().__init__().
            depth = module.__dict__.get("_strata_init_depth", 0)
            module.__dict__["_strata_init_depth"] = depth + 1
            try:
                original(module, *args, **kwargs)
            finally:
                module.__dict__["_strata_init_depth"] = depth
            if depth == 0:
                del module.__dict__["_strata_init_depth"]
                init._stage(module)

        wrapped._strata_original = original
        cls.__init__ = wrapped
        self._patched.append((cls, original))

    def _stage(self, module):
        if self._cpp is None:
            return
        with torch.no_grad():
            for p in module.parameters(recurse=False):
                # An fp32 Init casts nothing (a parameter built in 16 bits stays so); a 16-bit
                # one casts every floating-point parameter, frozen ones too, as DeepSpeed does.
                if self.dtype != torch.float32 and p.is_floating_point() and p.dtype != self.dtype:
                    p.data = p.data.to(self.dtype)
                if p.requires_grad and id(p) not in self._staged:
                    self._cpp.stage(p)
                    self._staged.add(id(p))
                    if self._several_ranks:
                        p._strata_rank0_values = True


def _memory_backed(path):
    """Whether `path` lies on a file system kept in memory (tmpfs, ramfs, devtmpfs), by the longest mount
    point above it in /proc/self/mountinfo; False when that cannot be read."""
    real = os.path.realpath(path)
    best, fstype = "", None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields, _, rest = line.partition(" - ")
                parts = fields.split()
                if len(parts) < 5 or not rest:
                    continue
                # Spaces and the like are octal escapes there (\040).
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4])
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, fstype = point, rest.split()[0]
    except OSError:
        return False
    return fstype in ("tmpfs", "ramfs", "devtmpfs")


def _staging_dir_of(zero_cfg):
    """The staging directory a config names: the NVMe tier's first directory, as the engine
    orders them (ZeroConfig::NvmeTierPaths: the optimizer section's when it offloads to nvme,
    then the parameter section's), else either section's nvme_path (parameters first); None
    when it names none."""
    def paths(key):
        path = zero_cfg.get(key, {}).get("nvme_path") or []
        return path if isinstance(path, list) else [path]
    for key in ("offload_optimizer", "offload_param"):
        if zero_cfg.get(key, {}).get("device") == "nvme" and paths(key):
            return paths(key)[0]
    for key in ("offload_param", "offload_optimizer"):
        if paths(key):
            return paths(key)[0]
    return None


def _default_staging_dir():
    """The system's temporary directory, unless it is kept in memory and TMPDIR (or TEMP, TMP)
    does not ask for it (Debian 13 mounts /tmp as tmpfs): then /var/tmp, which stays on disk, where the FHS puts
    large temporary files. A staging file in memory would hold the model in DRAM, which is what
    zero.Init is for avoiding."""
    import tempfile

    tmp = tempfile.gettempdir()
    asked = any(os.environ.get(v) for v in ("TMPDIR", "TEMP", "TMP"))  # tempfile's order
    if (_memory_backed(tmp) and not asked and os.access("/var/tmp", os.W_OK)
            and not _memory_backed("/var/tmp")):
        return "/var/tmp"
    return tmp


_active_init = None
_INIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _default_dtype(cfg):
    """bf16 where the config's master is the bf16 working copy (nothing of fp32 is kept), else
    fp32. DeepSpeed accepts "bfloat16" as the section's other name; "auto" (Hugging Face's
    unfilled value) is not true."""
    section = cfg.get("bf16", cfg.get("bfloat16", {}))
    if not isinstance(section, dict):
        return torch.float32
    master16 = section.get("enabled") is True and section.get("bf16_master_weights_and_grads") is True
    return torch.bfloat16 if master16 else torch.float32


def _module_classes():
    seen, stack = [], [torch.nn.Module]
    while stack:
        cls = stack.pop()
        seen.append(cls)
        stack.extend(c for c in cls.__subclasses__() if c not in seen)
    return seen


class MiCS_Init(Init):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's MiCS_Init: ZeRO-3 sharding within groups of mics_shard_size ranks, replicated
    across groups. With one group (mics_shard_size equal to the world size, or -1) that is
    ZeRO-3 itself, which is what Strata runs; smaller groups are refused, since Strata shards
    every parameter across all ranks."""

    def __init__(self, module=None, data_parallel_group=None, sequence_data_parallel_group=None,
                 mem_efficient_linear=True, remote_device=None, pin_memory=False,
                 config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 **kwargs):
        from . import config as _config
        from .unsupported import NotSupportedError, message

        cfg, _ = _config.load(config_dict_or_path if config_dict_or_path is not None else config)
        shard = cfg.get("zero_optimization", {}).get("mics_shard_size", -1)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if shard not in (-1, world):
            raise NotSupportedError(
                f"MiCS_Init with mics_shard_size={shard} on {world} rank(s): {message('mics')} "
                f"(mics_shard_size={world}, one group, is ZeRO-3 and runs)")
        super().__init__(module=module, data_parallel_group=data_parallel_group,
                         mem_efficient_linear=mem_efficient_linear, remote_device=remote_device,
                         pin_memory=pin_memory, config_dict_or_path=config_dict_or_path,
                         config=config, enabled=enabled, dtype=dtype, mpu=mpu)
