"""The trainer's side of batchq: ``ServerDataStream``, Fuel's class on Redis.

The PyTorch adapter (``TorchStream``) is :mod:`consumer.torch`, imported from there
alone: it needs the ``torch`` extra, and the package stays importable without torch.
"""

from __future__ import annotations

from consumer.stream import ServerDataStream

__all__ = ["ServerDataStream"]

_IN_TORCH = frozenset({"DataLoaderDispatchError", "DataLoaderWorkersError", "TorchStream"})


def __getattr__(name: str) -> object:
    # Not imported from here (torch is optional): say where the adapter's names live.
    if name in _IN_TORCH:
        raise AttributeError(
            f"module 'consumer' has no attribute {name!r}: import it from consumer.torch "
            f"(from consumer.torch import {name}; needs the torch extra)"
        )
    raise AttributeError(f"module 'consumer' has no attribute {name!r}")
