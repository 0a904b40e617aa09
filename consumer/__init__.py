"""The trainer's side of batchq: ``ServerDataStream``, Fuel's class on Redis."""

from consumer.stream import ServerDataStream

__all__ = ["ServerDataStream"]
