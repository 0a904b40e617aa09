"""The trainer's side of batchq: ``ServerDataStream``, Fuel's class on Redis.

``TorchStream`` (the PyTorch adapter, :mod:`consumer.torch`) needs the ``torch`` extra;
it is imported on first use, so that batchq imports without torch.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from consumer.stream import ServerDataStream

__all__ = ["ServerDataStream"]
if importlib.util.find_spec("torch") is not None:
    __all__ = ["ServerDataStream", "TorchStream"]


def __getattr__(name: str) -> Any:
    if name in ("DataLoaderDispatchError", "DataLoaderWorkersError", "TorchStream"):
        try:
            from consumer import torch as adapter
        except ImportError as e:
            raise ImportError(
                f"consumer.{name} needs PyTorch: pip install 'batchq[torch]' ({e})"
            ) from e
        return getattr(adapter, name)
    raise AttributeError(f"module 'consumer' has no attribute {name!r}")
