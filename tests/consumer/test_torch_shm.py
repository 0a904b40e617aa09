"""The torch adapter over shared memory: tensors stay valid as long as they are held."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import pytest
from pipelines import examples_of, numbered
from waiting import wait_until

from batchq.protocol.keys import QueueKeys
from batchq.wire import shm
from consumer import ServerDataStream
from producer import Producer

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(shm.host_identity() is None, reason="no writable /dev/shm")

EXAMPLES, BATCH = 200, 10


def test_tensors_over_shared_memory_stay_valid_while_referenced(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Producer], redis_client: Any
) -> None:
    from consumer.torch import TorchStream

    stream = ServerDataStream(("features", "targets"), url=redis_url, queue=queue_name)
    held: list[tuple[Any, list[int]]] = []
    with TorchStream(stream) as ts:
        # The trainer's host is published before the producer starts, so the producer sees
        # it when it joins. (Started first, it makes frames for Redis until it looks again:
        # at its next batch after a wait at the cap, or a second later; a short run may
        # end before either.) The first batch is taken in a thread: it claims, publishes
        # and waits for the plan.
        it = iter(ts)
        first: list[Any] = []
        errors: list[BaseException] = []

        def take_first() -> None:
            try:
                first.append(next(it))
            except BaseException as e:  # reported below, in the test's thread
                errors.append(e)

        opener = threading.Thread(target=take_first)
        opener.start()
        meta = QueueKeys(queue_name).meta
        wait_until(lambda: redis_client.hget(meta, "shm_host") or errors, what="the host")
        producer = producer_thread(numbered(EXAMPLES, BATCH), hwm=3)
        transport = producer._transport
        opener.join(timeout=60)
        assert not errors, errors
        assert first, "the first batch did not come within 60 s"
        for epoch in range(3):  # 60 batches through a pool of at most 16 segments: reuse
            batches = itertools.chain(first, it) if epoch == 0 else iter(ts)
            for i, (features, _targets) in enumerate(batches):
                assert isinstance(features, torch.Tensor)
                features.add_(0)  # writable in place: the tensor owns its memory
                if i % 10 == 0:  # kept (6 of them, fewer than the pool); the rest let go
                    held.append((features, examples_of(features.numpy())))
        plan = numbered(EXAMPLES, BATCH).get_epoch_iterator()
        expected = [examples_of(f) for f, _ in plan]
        # Segments of the batches let go were reused while the kept ones were held: more
        # frames went through shared memory than the pool has segments.
        made = len(transport.pool.segments)
        assert transport.shm_frames > made, (
            f"{transport.shm_frames} frames by shm, {made} segments (at most "
            f"{transport.pool.max_segments}), {transport.fallbacks} fell back to Redis"
        )
        ts.close(finished=True)
    # Every tensor kept, epochs later, still holds its own batch.
    now = [examples_of(t.numpy()) for t, _ in held]
    assert now == [seen for _, seen in held], "a kept tensor's segment was overwritten"
    assert [seen for _, seen in held[:2]] == [expected[0], expected[10]]
