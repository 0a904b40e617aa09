"""ServerDataStream's own behaviour (its parts have their own files: test_start,
test_session, test_stream_options, ...), against the real redis-server."""

from __future__ import annotations

from typing import Any

import pytest
from data_parallel import two_ranks_in_epoch_2
from pipelines import examples_of, numbered

from batchq.errors import StreamStopped, TrainerConflict
from batchq.protocol.fields import MetaField
from batchq.protocol.keys import QueueKeys
from consumer import ServerDataStream


def test_finishing_a_stream_that_never_read_leaves_a_live_trainers_run(
    redis_url: str, queue_name: str, producer_thread: Any, redis_client: Any
) -> None:
    # Issue 39: a second stream of the same job (made, never read) closed with
    # finished=True while the first one trains raised TrainerConflict.
    producer_thread(numbered(40, 10))
    keys = QueueKeys(queue_name)
    with ServerDataStream(("features", "targets"), url=redis_url, queue=queue_name) as reading:
        next(reading.get_epoch_iterator())
        idle = ServerDataStream(
            ("features", "targets"), url=redis_url, queue=queue_name, claim_ttl_s=0.5
        )
        idle.close(finished=True)  # waits out a claim that could lapse, then leaves it
        assert redis_client.hget(keys.meta, MetaField.FINISHED) is None
        assert len(list(reading.get_epoch_iterator())) == 4  # still its run


def test_len_of_an_epoch_re_split_for_another_world_is_unknown() -> None:
    # Its count is the remap's on top of what the old ranks had: an iterator's end tells.
    import pytest

    from batchq.errors import LengthUnknown
    from consumer.rank_state import elastic_state

    old = two_ranks_in_epoch_2()
    stream = ServerDataStream(("x",), url="redis://127.0.0.1:1/0", queue="q", rank=0, world_size=3)
    stream.load_state_dict(old)
    assert elastic_state(old, 0, 3)["remap"]
    with pytest.raises(LengthUnknown, match="epoch 2 was re-split for 3 ranks"):
        len(stream)


def test_a_later_stream_of_this_process_takes_over_one_between_epochs(
    redis_url: str, queue_name: str, producer_thread: Any
) -> None:
    # A framework that asks its dataloader hook again makes a new stream while the one
    # it dropped still holds the queue: between two epochs, the new one reads on.
    producer_thread(numbered(40, 10))
    plan = numbered(40, 10)
    epochs = [[examples_of(f) for f, _ in plan.get_epoch_iterator()] for _ in range(3)]
    first = ServerDataStream(("features", "targets"), url=redis_url, queue=queue_name)
    assert [examples_of(f) for f, _ in first.get_epoch_iterator()] == epochs[0]
    second = ServerDataStream(("features", "targets"), url=redis_url, queue=queue_name)
    assert [examples_of(f) for f, _ in second.get_epoch_iterator()] == epochs[1]
    with pytest.raises(StreamStopped):  # closed by the takeover
        next(first.get_epoch_iterator())
    it = second.get_epoch_iterator()
    assert examples_of(next(it)[0]) == epochs[2][0]
    third = ServerDataStream(("features", "targets"), url=redis_url, queue=queue_name)
    with pytest.raises(TrainerConflict, match="an earlier stream of this process, in the mid"):
        third.get_epoch_iterator()  # the second is in the middle of an epoch: still its
    third.close()
    assert [examples_of(f) for f, _ in it] == epochs[2][1:]
    second.close(finished=True)


def test_a_rank_of_a_data_parallel_job_is_not_taken_over(
    redis_url: str, queue_name: str, producer_thread: Any
) -> None:
    # The takeover is a resume, and one rank's resume replaces the run: another rank's
    # finish and reading went with it (a review's repro lost the finish 8 times in 8).
    producer_thread(numbered(40, 10))
    kwargs: dict[str, Any] = dict(url=redis_url, queue=queue_name, rank=0, world_size=2)
    first = ServerDataStream(("features", "targets"), **kwargs)
    assert len(list(first.get_epoch_iterator())) == 2  # its share, to the epoch's end
    second = ServerDataStream(("features", "targets"), **kwargs)
    with pytest.raises(TrainerConflict, match="rank 0 of a data-parallel job"):
        second.get_epoch_iterator()
    second.close()
    first.close()
