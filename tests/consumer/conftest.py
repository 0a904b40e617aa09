"""Fixtures for the trainer-side tests: producers in threads or in processes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from producer import Producer, StripedProducer


@pytest.fixture
def producer_thread(
    queue_url: str, queue_name: str, queue_stripes: int
) -> Iterator[Callable[..., Any]]:
    """Start Producers serving in threads (StripedProducers where ``queue_url`` is
    parametrized "stripes"); each is stopped when the test ends."""
    started: list[tuple[Producer | StripedProducer, threading.Thread]] = []

    def start(stream: Any, **options: Any) -> Producer | StripedProducer:
        options.setdefault("hwm", 4)
        producer: Producer | StripedProducer
        if queue_stripes > 1:
            producer = StripedProducer(
                stream, queue_url, queue_name, stripes=queue_stripes, **options
            )
        else:
            producer = Producer(stream, queue_url, queue_name, **options)
        thread = threading.Thread(target=producer.serve, daemon=True)
        thread.start()
        started.append((producer, thread))
        return producer

    yield start
    for producer, thread in started:
        producer.stop()
        thread.join(timeout=10)
        if thread.is_alive():
            pytest.fail("a producer thread did not stop within 10 s")
