"""``start_server(stream, ...)``: Fuel's ``fuel.server.start_server`` on Redis.

It blocks, serving epoch after epoch, until the trainer finishes the run (then it
returns 0) or the process is asked to stop (SIGINT/SIGTERM: its leases go back to the
work list first). ``stripes=N`` serves a queue striped over N slots
(:class:`producer.striped.StripedProducer`); otherwise one :class:`producer.Producer`.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from batchq.client.connection import resolve_url
from batchq.protocol.stripes import check_stripes
from producer.producer_options import check_stream
from producer.quarantine import set_sample_errors
from producer.server import Producer
from producer.striped import StripedProducer

__all__ = ["start_server"]


def start_server(
    data_stream: Any,
    port: int | None = None,
    hwm: int = 10,
    *,
    host: str | None = None,
    queue: str = "default",
    url: str | None = None,
    handle_signals: bool = True,
    stripes: int = 1,
    on_sample_error: str | None = None,
    max_quarantined: float | None = None,
    **options: Any,
) -> int:
    """Serve ``data_stream`` into a Redis queue, epoch after epoch (Fuel's start_server).

    Args:
        data_stream: the stream to serve.
        port: Redis port (default 6379; see the connection order in the README).
        hwm: the most elements the queue may hold (the run's cap; each stripe's).
        host: Redis host (default localhost).
        queue: the queue's name.
        url: a redis://, rediss://, redis+cluster:// or redis+sentinel:// URL; wins over
            host/port.
        handle_signals: stop cleanly on SIGINT/SIGTERM (main thread only).
        stripes: split the queue over this many slots (on a cluster, masters), fixed
            when the run is created (:mod:`batchq.protocol.stripes`).
        on_sample_error: 'raise' or 'quarantine' (:mod:`producer.quarantine`), set on
            the stream's root (a map-style DatasetStream, or a Fuel DataStream that reads
            examples by index); None: the stream's own.
        max_quarantined: the fraction of an epoch's examples that may be quarantined;
            None: the stream's own.
        **options: passed to :class:`Producer` (window, requests_per_shard, ...).

    Returns:
        0 once the trainer finished the run or a stop was requested.
    """
    check_stream(data_stream)
    where = resolve_url(url, host, port)
    if on_sample_error is not None or max_quarantined is not None:
        set_sample_errors(data_stream, on_sample_error, max_quarantined)
    producer: Producer | StripedProducer
    if check_stripes(stripes) > 1:
        producer = StripedProducer(data_stream, where, queue, hwm, stripes=stripes, **options)
    else:
        producer = Producer(data_stream, where, queue, hwm, **options)
    installed: dict[signal.Signals, Any] = {}
    if handle_signals and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            installed[sig] = signal.signal(sig, lambda *_: producer.stop())
    try:
        return producer.serve()
    finally:
        for sig, handler in installed.items():
            signal.signal(sig, handler)
