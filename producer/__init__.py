"""The producer side of batchq: Fuel's pipeline (datasets, schemes, streams,
transformers, under their Fuel module names) and the serving loop ``start_server``.
"""

from producer.server import Producer, start_server

__all__ = ["Producer", "start_server"]
