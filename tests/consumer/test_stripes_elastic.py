"""Stripes x elastic resume: a data-parallel job on a striped queue, checkpointed with
every rank's state, resumed by more ranks or fewer, every epoch exact."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from data_parallel import BATCH, EXAMPLES, check_elastic_resume, elastic_restart
from train import lines
from waiting import wait_until

STRIPES = 2


@pytest.mark.parametrize(("old", "new", "stop"), [(2, 3, 4), (3, 2, 3)])
def test_a_striped_jobs_elastic_resume_keeps_every_epoch_exact(
    redis_url: str,
    queue_name: str,
    serve_argv: Any,
    serve_env: Any,
    spawn_proc: Any,
    tmp_path: Path,
    old: int,
    new: int,
    stop: int,
) -> None:
    argv = serve_argv("--hwm", "4", "--heartbeat-ttl-s", "2", "--stripes", str(STRIPES))
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=20)
    producers = [spawn_proc(argv, env=env) for _ in range(2)]
    epochs = 3
    outs, outs_b, second = elastic_restart(
        spawn_proc, redis_url, queue_name, tmp_path, epochs, old, new, stop
    )
    # A producer killed mid-epoch (20 ms a batch: the re-split one, as a rule): the other
    # rebuilds its leases, a remapped slot as remapped.
    wait_until(
        lambda: sum(len(lines(o)) for o in outs_b) >= new, timeout_s=60, what="resumed batches"
    )
    producers[0].send_signal(signal.SIGKILL)
    for proc in second:
        assert proc.wait(timeout=90) == 0
    check_elastic_resume(outs, outs_b, epochs, old, new, stop)
    assert producers[1].wait(timeout=30) == 0  # the last rank's close(finished=True)
