"""The trainer's side of batchq: ``ServerDataStream``, Fuel's class on Redis.

The PyTorch adapter (``TorchStream``) is :mod:`consumer.torch`, imported from there
alone: it needs the ``torch`` extra, and the package stays importable without torch.
"""

from __future__ import annotations

from consumer.stream import ServerDataStream

__all__ = ["ServerDataStream"]
