"""The producer side of batchq: Fuel's pipeline (datasets, schemes, streams,
transformers, under their Fuel module names) and the serving loop ``start_server``.
"""

from producer.server import Producer
from producer.start import start_server
from producer.striped import StripedProducer

__all__ = ["Producer", "StripedProducer", "start_server"]
