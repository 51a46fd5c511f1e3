"""Compute spans per block, recorded from module hooks, for the message timelines.

``minitp.comm`` records every message; this records the compute around them, so a timeline can
show *which* part of backward was running when a message went out. For each block (by default the
model's top-level children, with a ``ModuleList`` opened into its items):

* ``forward``: from the block's forward pre-hook to its forward hook;
* ``backward``: from the moment the gradient of the block's output is ready (a hook on the output
  tensor) to the moment the last of the block's own parameters has its gradient accumulated
  (``register_post_accumulate_grad_hook``), which is exactly when DDP counts those gradients ready.

Each span is an ``Event(kind="compute", op="forward"|"backward", label=<block name>)`` added to
``minitp.trace.current()``; nothing is recorded when no trace is recording.

Register the hooks *before* wrapping the model in DDP: hooks run in the order they were
registered, so a block's backward span then ends before DDP's own hook launches its bucket.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from minitp import trace as _trace


def blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The model's top-level children, each ``ModuleList``/``Sequential`` opened into its items:
    ``tok_embeddings, layers.0, ..., layers.3, norm, output`` for the LLaMA model."""
    out: dict[str, nn.Module] = {}
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            out.update({f"{name}.{i}": sub for i, sub in enumerate(child)})
        else:
            out[name] = child
    return out


def _add(op: str, label: str, start: float, end: float) -> None:
    tr = _trace.current()
    if tr is not None:
        tr.add(_trace.Event(tr.rank, "compute", op, tr.label(label), start, end))


class ComputeRecorder:
    """The hooks that ``record_compute`` put in place; ``remove()`` (or leaving the ``with``
    block) takes them away."""

    def __init__(self, modules: dict[str, nn.Module], forward: bool, backward: bool):
        self.handles: list = []
        for name, module in modules.items():
            params = [p for p in module.parameters() if p.requires_grad]
            if forward:
                self._hook_forward(name, module)
            if backward and params:
                self._hook_backward(name, module, params)

    def _hook_forward(self, name: str, module: nn.Module) -> None:
        started: list[float] = []

        def pre(mod, args):
            started.append(time.perf_counter())

        def post(mod, args, output):
            if started:
                _add("forward", name, started.pop(), time.perf_counter())

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def _hook_backward(self, name: str, module: nn.Module, params: list[nn.Parameter]) -> None:
        state = {"start": None, "left": 0}

        def output_grad_ready(grad):  # backward reaches the block: its output's gradient exists
            state["start"], state["left"] = time.perf_counter(), len(params)
            return None

        def after_forward(mod, args, output):
            if torch.is_grad_enabled() and isinstance(output,
                                                      torch.Tensor) and output.requires_grad:
                output.register_hook(output_grad_ready)

        def param_grad_ready(param):  # the block is done once all its parameters have gradients
            if state["start"] is None:
                return
            state["left"] -= 1
            if state["left"] == 0:
                _add("backward", name, state["start"], time.perf_counter())
                state["start"] = None

        self.handles.append(module.register_forward_hook(after_forward))
        self.handles += [p.register_post_accumulate_grad_hook(param_grad_ready) for p in params]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def __enter__(self) -> ComputeRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def record_compute(model: nn.Module, modules: dict[str, nn.Module] | None = None,
                   forward: bool = True, backward: bool = True) -> ComputeRecorder:
    """Record a forward and a backward compute span per block of ``model`` into the current trace.

    modules: {label: module} to time instead of ``blocks(model)``.
    """
    return ComputeRecorder(blocks(model) if modules is None else modules, forward, backward)
