"""The floor a pop advanced is published before the reader idles (issue 11, point 9).

Before: the floor sent with a pop was read before the frames it popped were filed; a
reader that then idled (its buffer full) left the published floor behind, and producers
waited at the look-ahead window with the list not full (16 producers: the list sat at
3 of 4 for two minutes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from pipelines import examples_of, numbered
from waiting import wait_until

from batchq.protocol.keys import QueueKeys
from consumer import ServerDataStream


def test_the_floor_is_published_when_the_reader_idles(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    producer_thread: Callable[..., Any],
) -> None:
    keys = QueueKeys(queue_name)
    producer_thread(numbered(200, 10), hwm=4)
    with ServerDataStream(
        ("features", "targets"), url=redis_url, queue=queue_name, hwm=3, timeout_s=20
    ) as stream:
        it = stream.get_epoch_iterator()
        first = examples_of(next(it)[0])
        reader, buffer = stream._reader, stream._buffer
        assert reader is not None and buffer is not None
        ledger = buffer.ledger

        def settled() -> bool:
            with buffer.cond:
                idle = ledger.buffered >= reader.settings.options.hwm and not ledger.needs_more()
                floor = ledger.floor()
            published = int(redis_client.hget(keys.meta, "floor") or -1)
            return idle and published == floor

        wait_until(settled, timeout_s=10, what="the published floor to reach the ledger's")
        rest = [examples_of(f) for f, _ in it]
    local = numbered(200, 10)
    assert [first, *rest] == [examples_of(f) for f, _ in local.get_epoch_iterator()]
