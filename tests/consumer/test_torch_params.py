"""TorchStream steers the producers too: set_params at the loop's position (the batches
prefetched to the device do not count as handed out) and the params of the batch the
loop has, not of the one prefetched last."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from pipelines import steered

torch = pytest.importorskip("torch")

from batchq.monitoring.rows import queue_status  # noqa: E402
from batchq.protocol.params_log import thaw  # noqa: E402
from consumer import ServerDataStream  # noqa: E402
from consumer.torch import TorchStream  # noqa: E402
from consumer.torch_memory import DeviceMover  # noqa: E402

EXAMPLES, BATCH = 400, 10  # 40 batches an epoch, one per shard: index = step


@pytest.mark.parametrize("device_path", [False, True])
def test_torch_stream_sets_params_at_the_loops_position(
    redis_url: str,
    redis_client: Any,
    queue_name: str,
    producer_thread: Callable[..., Any],
    device_path: bool,
) -> None:
    producer_thread(steered(EXAMPLES, BATCH), hwm=4)
    stream = ServerDataStream(("features", "params"), url=redis_url, queue=queue_name)
    ts = TorchStream(stream, prefetch=4)
    if device_path:  # the device path on torch's CPU stand-ins: up to 4 batches ahead
        ts.mover = DeviceMover(torch.device("cpu"), backend=torch.cpu)
    seen = []
    with ts:
        for step, (_, params) in enumerate(ts, start=1):
            assert thaw(ts.params) == json.loads(params)  # the batch the loop has
            seen.append(json.loads(params))
            if step == 3:
                lookahead = queue_status(redis_client, queue_name)["lookahead_batches"]
                assert ts.set_params({"level": 1}) == 3 + lookahead
                assert ts.set_params({"level": 2}, at_epoch=1) == 40
    assert seen[: 3 + lookahead] == [{}] * (3 + lookahead)
    assert seen[3 + lookahead :] == [{"level": 1}] * (40 - 3 - lookahead)
