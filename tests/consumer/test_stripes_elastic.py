"""Stripes x elastic resume: a data-parallel job on a striped queue, checkpointed with
every rank's state, resumed by more ranks or fewer, every epoch exact."""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from train import lines
from waiting import wait_until

from tests.consumer.test_data_parallel import (
    BATCH,
    EXAMPLES,
    check_epoch,
    checkpoint_ranks,
    plans,
    shares,
    spawn_ranks,
)

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
    outs, saved = checkpoint_ranks(spawn_proc, redis_url, queue_name, tmp_path, epochs, old, stop)
    (tmp_path / "all.json").write_text(json.dumps(saved))
    outs_b = [tmp_path / f"b{r}.jsonl" for r in range(new)]
    second = spawn_ranks(
        spawn_proc, redis_url, queue_name, outs_b, epochs, "--finish",
        "--state-in", str(tmp_path / "all.json"),
    )  # fmt: skip
    # A producer killed mid-epoch (20 ms a batch: the re-split one, as a rule): the other
    # rebuilds its leases, a remapped slot as remapped.
    wait_until(
        lambda: sum(len(lines(o)) for o in outs_b) >= new, timeout_s=60, what="resumed batches"
    )
    producers[0].send_signal(signal.SIGKILL)
    for proc in second:
        assert proc.wait(timeout=90) == 0
    plan = plans(epochs)
    before = [b for o in outs for _, b in lines(o)]
    assert len(before) == old * stop  # all of epoch 0, one slot per rank at a time
    after = shares(outs_b, epochs)
    rest = after[0]
    # The rest of epoch 0, re-split: equal counts, the least padding.
    units = plan[0][old * stop :]
    per = -(-len(units) // new)
    assert [len(s) for s in rest] == [per] * new
    padded = units + units[: per * new - len(units)]
    assert rest == [padded[r::new] for r in range(new)]
    got = Counter(tuple(b) for b in before + [b for s in rest for b in s])
    want = Counter(tuple(b) for b in plan[0] + units[: per * new - len(units)])
    assert got == want  # exactly the epoch, plus the documented pads
    for e in range(1, epochs):
        check_epoch(plan[e], after[e], new)
    assert producers[1].wait(timeout=30) == 0  # the last rank's close(finished=True)
