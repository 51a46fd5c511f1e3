"""minitp: data, fully sharded, tensor, pipeline, context and expert parallelism from scratch on
torch.distributed.

``import minitp.ddp`` (or any strategy) loads only what that strategy reads: the traced road
(``comm``, ``regions``, ``trace``), ``layout``, ``mesh`` and ``models``. The conveniences below
(``minitp.launch(fn, n)``, ``minitp.cost``, ...) are loaded the first time they are used.
"""

import importlib

__version__ = "0.1.0"
_MODULES = ("comm", "cost", "trace")
_LAUNCHER = ("launch", "device", "Results", "LaunchError", "RankError", "LaunchTimeout")
__all__ = [*_MODULES, *_LAUNCHER]


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f"minitp.{name}")
    if name in _LAUNCHER:
        value = getattr(importlib.import_module("minitp.launcher"), name)
        globals()[name] = value  # once: later lookups find it here
        return value
    raise AttributeError(f"module 'minitp' has no attribute {name!r}")
