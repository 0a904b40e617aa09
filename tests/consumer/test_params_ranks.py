"""With data-parallel ranks a change applies to the run, at an index in the run's global
numbering: any rank may make it (ranks making the same call at the same step add it
once), and every rank's batches from that index on are built with it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from pipelines import steered

from batchq.monitoring.rows import queue_status
from batchq.protocol.params_log import thaw
from consumer import ServerDataStream

EXAMPLES, BATCH = 400, 10  # 40 slots an epoch, one batch each: 20 per rank (2 epochs)
WORLD = 2


@pytest.mark.parametrize("callers", [(0,), (0, 1)])
def test_a_change_by_one_rank_applies_to_every_rank_at_the_same_index(
    redis_url: str,
    redis_client: Any,
    queue_name: str,
    producer_thread: Callable[..., Any],
    callers: tuple[int, ...],
) -> None:
    producer_thread(steered(EXAMPLES, BATCH), hwm=4)
    streams = [
        ServerDataStream(
            ("features", "params"), url=redis_url, queue=queue_name, rank=r, world_size=WORLD
        )
        for r in range(WORLD)
    ]
    change = None
    step = 0
    for _ in range(2):
        its = [s.get_epoch_iterator() for s in streams]
        for batches in zip(*its, strict=True):  # the ranks in step, as a DDP loop keeps them
            for r, (_, params) in enumerate(batches):
                index = step * WORLD + r  # rank r's batch number `step`, in the run's numbering
                want = {"level": 1} if change is not None and index >= change else {}
                assert json.loads(params) == want, f"rank {r} step {step}"
                assert thaw(streams[r].params) == want
            step += 1
            if step == 5:
                lookahead = queue_status(redis_client, queue_name)["lookahead_batches"]
                got = {streams[r].set_params({"level": 1}) for r in callers}
                assert got == {5 * WORLD + lookahead}  # one index: the run's position + D
                change = got.pop()
    for s in streams:
        assert [e["index"] for e in s.state_dict()["params"]] == [change]
        s.close(finished=True)
    assert queue_status(redis_client, queue_name)["params_version"] == 1
