"""Frames that decode but name an impossible position are bad frames (issue 11).

A rogue writer (or a bit flip in an unchecked header) pushes well-formed frames of the
live run whose address, count or epoch no producer could have written. Before the fix
they were held for ever (the epoch never ended, the buffer grew without bound) or handed
to the trainer in place of the real batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import redis
from pipelines import FEATURES, Slow, examples_of, numbered

from batchq.protocol.keys import QueueKeys
from batchq.wire import codec
from consumer import ServerDataStream
from consumer.reader.ledger import Ledger

EXAMPLES, BATCH = 60, 10  # 6 batches per epoch
HWM = 10


def reference(epochs: int) -> list[list[int]]:
    local = numbered(EXAMPLES, BATCH)
    return [examples_of(f) for _ in range(epochs) for f, _ in local.get_epoch_iterator()]


def rogue(run: str, epoch: int, shard: int, k: int, *, last: bool = False, count: Any = None):  # type: ignore[no-untyped-def]
    features = np.full((BATCH, FEATURES), -1, dtype=np.int64)
    return bytes(
        codec.encode_frame(
            codec.FrameHeader(
                codec.FrameKind.BATCH,
                run=run,
                epoch=epoch,
                shard=shard,
                k=k,
                producer="rogue",
                sources=("features", "targets"),
                last=last,
                count=count,
            ),
            (features, np.arange(BATCH)),
        )
    )


CASES = {
    # k=5 in a shard that has one batch: held for ever before (the epoch never ended).
    "k_past_the_shard": dict(k=5),
    # batch 0 with last=True, count=3: handed out in place of the real batch before.
    "count_that_does_not_fit_k": dict(k=0, last=True, count=3),
    # an epoch far past the look-ahead window: dropped and counted while k fits the plan
    # (the run can deliver a shard past the window: one leased under a floor further
    # ahead, issue 28), impossible once k is past the plan's 6 batches per epoch.
    "epoch_past_the_window": dict(k=0, epoch=40),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_impossible_frame_is_dead_listed_and_the_epochs_stay_exact(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    producer_thread: Callable[..., Any],
    case: str,
) -> None:
    keys = QueueKeys(queue_name)
    # Slow and capped at 2: the last shard is still to come when the rogue frames land.
    producer_thread(Slow(numbered(EXAMPLES, BATCH), slowdown=0.05), hwm=2)
    with ServerDataStream(
        ("features", "targets"),
        url=redis_url,
        queue=queue_name,
        hwm=HWM,
        timeout_s=20,
        on_bad_frame="skip",
    ) as stream:
        it = stream.get_epoch_iterator()
        served = [examples_of(next(it)[0])]
        assert stream._session is not None
        run, shards = stream._session.run, stream._buffer.ledger.shards  # type: ignore[union-attr]
        spec = dict(CASES[case])
        epoch = int(spec.pop("epoch", 0))
        k = int(spec.pop("k"))
        for i in range(50):  # many, at distinct addresses: the buffer must stay bounded
            step = i if case != "count_that_does_not_fit_k" else 0
            redis_client.rpush(keys.data, rogue(run, epoch + step, shards - 1, k + step, **spec))
        served += [examples_of(f) for f, _ in it]
        served += [examples_of(f) for f, _ in stream.get_epoch_iterator()]
        assert stream.max_buffered <= HWM + 2
        ahead = stream.stats["dropped_ahead"]
    assert served == reference(2)
    if case == "epoch_past_the_window":
        assert ahead == 6  # k = 0..5 of 0..49
    dead = [msgpack.unpackb(r)["reason"] for r in redis_client.lrange(keys.dead, 0, -1)]
    assert dead and set(dead) == {"impossible"}


def frame(epoch: int, shard: int, k: int, *, last: bool = False, count: int | None = None):  # type: ignore[no-untyped-def]
    return codec.decode_frame(
        codec.encode_frame(
            codec.FrameHeader(
                codec.FrameKind.BATCH,
                run="r",
                epoch=epoch,
                shard=shard,
                k=k,
                producer="p",
                sources=("x",),
                last=last,
                count=count,
            ),
            (np.zeros(1),),
        )
    )


def test_ledger_purges_held_frames_past_a_count_learnt_later() -> None:
    ledger = Ledger(2, first_epoch=0)
    ledger.window = 4
    assert ledger.impossible(frame(0, 1, 5)) is None  # nothing known yet: held
    ledger.add(frame(0, 1, 5))
    assert ledger.buffered == 1
    ledger.add(frame(0, 1, 0, last=True, count=1))
    assert ledger.buffered == 1  # only the real batch
    assert [f.k for f, _ in ledger.purged] == [5]
    assert ledger.impossible(frame(0, 1, 3)) is not None  # the count is known now
    assert ledger.impossible(frame(0, 1, 0, last=True, count=2)) is not None
    # g = 4 is past the window [0, 4): possible (a shard leased under a floor further
    # ahead), dropped to be built again when due; g = 3 is inside it.
    assert ledger.impossible(frame(2, 0, 0)) is None and ledger.ahead(frame(2, 0, 0))
    assert not ledger.ahead(frame(1, 1, 0))
