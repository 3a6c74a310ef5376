"""strata.checkpoint_utils: clone_tensors_for_torch_save (DeepSpeed's
`deepspeed.checkpoint.utils`)."""

import torch


def clone_tensors_for_torch_save(item, device=torch.device("cpu")):
    """A copy of `item` (a tensor, or lists, tuples and dicts of them) whose tensors are
    detached clones on `device`, so that torch.save writes each tensor's own values and not the
    whole storage a view of a flat buffer shares (the engine's parameters below stage 3 are
    views of one chunk)."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item


__all__ = ["clone_tensors_for_torch_save"]
