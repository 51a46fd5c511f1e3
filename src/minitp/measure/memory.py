"""What a rank actually holds: bytes in parameters, gradients and optimizer state, counted from the
tensors themselves (each storage once), to set next to ``minitp.cost.memory_per_rank``."""

from __future__ import annotations

import torch


def storage_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors``, each storage counted once (views and shards that
    share one are not counted twice); None and non-tensors are skipped."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def held_bytes(params, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """{"params", "grads", "optimizer"}: bytes held by these parameters, their ``.grad`` and the
    optimizer's state tensors (AdamW: exp_avg, exp_avg_sq and the step counters)."""
    params = list(params)
    state = []
    if optimizer is not None:
        for s in optimizer.state.values():
            state.extend(v for v in s.values() if isinstance(v, torch.Tensor))
    return {
        "params": storage_bytes(params),
        "grads": storage_bytes(p.grad for p in params),
        "optimizer": storage_bytes(state),
    }
