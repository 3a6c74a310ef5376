"""fp16 on the CPU device: every operator LibTorch runs on fp16 CPU tensors computes in fp32 on
the fp16 values and rounds its result back to fp16.

LibTorch (1.13 and later) has no fp16 CPU kernels for matmul, convolution, LayerNorm, softmax,
exp and many more, so a model in fp16 on the CPU cannot run a forward. DeepSpeed refuses fp16 on a
CPU without AVX512-FP16. Strata keeps fp16's semantics a script can see (fp16 parameters,
activations and gradients, dynamic loss scaling, overflow skips) and computes each operator in
fp32: the result of an operator is the fp32 result rounded once to fp16, where a GPU's fp16 kernel
may round inside (in a dot product's partial sums, for one). Numerics therefore differ from a
GPU's in the last bits of fp16; the README says so.

The mode is a torch function mode, pushed once for the process when an fp16 engine is made on
the CPU device, and it sees every call from Python: the script's loss, the model's forward and
the backward's autograd graph, which records the casts (the gradient reaching an fp16 tensor is
the fp32 gradient rounded to fp16). Calls that only move, view or describe a tensor run as they
are, so views stay views and in-place writes land where they should.
"""

import threading
import warnings

import torch
from torch.overrides import TorchFunctionMode

# Calls that compute nothing: views, casts, copies, fills and descriptions. They run on fp16 as
# they are (LibTorch has CPU kernels for these), so aliasing is kept: an upcast view would be a
# copy, and a write through it would be lost.
_AS_IS = frozenset("""
    __getitem__ __setitem__ __len__ __iter__ __repr__ __format__ __reduce_ex__ __deepcopy__
    __hash__ __bool__ __array__ __index__ __int__ __float__
    alias as_strided chunk clone contiguous copy_ cpu cuda data_ptr detach detach_ diagonal dim
    double element_size expand expand_as fill_ flatten float half int long bool is_contiguous
    is_floating_point is_complex item movedim narrow ndimension nelement new_empty new_full
    new_ones new_tensor new_zeros numel numpy permute pin_memory requires_grad_ reshape
    reshape_as retain_grad select share_memory_ size split split_with_sizes squeeze squeeze_
    storage storage_offset stride t t_ to tolist transpose transpose_ type type_as unbind
    unflatten unfold unsqueeze unsqueeze_ view view_as zero_ cat stack empty_like zeros_like
    ones_like full_like register_hook backward get_device untyped_storage _typed_storage
    is_pinned is_shared is_set_to set_ record_stream bfloat16 byte char short tensor_split
    hsplit vsplit dsplit swapaxes swapdims moveaxis
""".split())


_RUNNING_STATS = frozenset(("batch_norm", "instance_norm", "_batch_norm_impl_index",
                            "native_batch_norm", "_native_batch_norm_legit"))


def _is_cpu_half(x):
    return isinstance(x, torch.Tensor) and x.dtype == torch.float16 and x.device.type == "cpu"


def _map(obj, fn):
    """`fn` applied to every tensor in `obj` (tuples, lists and dict values, as operators take)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        out = [_map(o, fn) for o in obj]
        return type(obj)(out) if isinstance(obj, list) else tuple(out)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj


def _any_cpu_half(obj):
    if isinstance(obj, torch.Tensor):
        return _is_cpu_half(obj)
    if isinstance(obj, (list, tuple)):
        return any(_any_cpu_half(o) for o in obj)
    if isinstance(obj, dict):
        return any(_any_cpu_half(v) for v in obj.values())
    return False


class CpuHalfMode(TorchFunctionMode):
    """Runs operators on fp16 CPU tensors in fp32, rounding their floating results to fp16."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__", "__delete__") or name in _AS_IS or \
                not (_any_cpu_half(args) or _any_cpu_half(kwargs)):
            return func(*args, **kwargs)
        # Each fp16 argument becomes an fp32 copy. A copy the operator wrote to (an in-place
        # operator's self, batch_norm's running statistics, an out= tensor) is written back to its
        # fp16 tensor, as a copy_ autograd records, so the write lands where the caller expects.
        copies = []

        def up(t):
            if not _is_cpu_half(t):
                return t
            c = t.float()
            copies.append((t, c, c._version))
            return c

        result = func(*_map(args, up), **_map(kwargs, up))
        # batch_norm and instance_norm update their running statistics inside the kernel, which
        # leaves the version counter alone: those (the arguments after the input that take no
        # gradient) are written back whatever the counter says.
        stats = name in _RUNNING_STATS
        first = args[0] if args else None
        written = {}
        for orig, c, version in copies:
            if c._version != version or (stats and orig is not first and not orig.requires_grad):
                orig.copy_(c)
                written[id(c)] = orig

        def down(t):
            if id(t) in written:
                return written[id(t)]
            return t.half() if t.dtype == torch.float32 and t.device.type == "cpu" else t

        return _map(result, down)


_lock = threading.Lock()
_mode = None


def enable():
    """Pushes the mode for this process (once; later calls do nothing) and warns once."""
    global _mode
    with _lock:
        if _mode is not None:
            return
        warnings.warn(
            "strata: fp16 on the cpu device computes each operator in fp32 on the fp16 values and "
            "rounds the result to fp16 (LibTorch has no fp16 CPU kernels for matmul, convolution "
            "or LayerNorm); loss scaling, overflow skips and fp16 storage are fp16's, but results "
            "differ from a GPU's fp16 kernels in the last bits", stacklevel=3)
        _mode = CpuHalfMode()
        _mode.__enter__()


def enabled():
    return _mode is not None
