"""Sentinel: ten forced failovers while two producers and a trainer run.

Half are ``SENTINEL FAILOVER`` (the old master demoted while it still takes writes, until
it is reconfigured), half a SIGKILL of the master (the sentinels fail over once they agree
it is down; it comes back as an empty replica). Asynchronous replication loses the last
writes before each: pushed frames, pops, leases, the ``next`` counter, heartbeats. The
trainer's epochs must still be exact (nothing lost, duplicated or reordered: plan order),
with no process restarted; the figures are printed (``-s``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from pipelines import examples_of, numbered
from train import argv as train_argv
from train import lines
from waiting import wait_until

EXAMPLES, BATCH = 400, 10  # 40 batches per epoch
FAILOVERS = 10


def reference(epochs: int) -> list[tuple[int, list[int]]]:
    stream = numbered(EXAMPLES, BATCH)
    return [(e, examples_of(f)) for e in range(epochs) for f, _ in stream.get_epoch_iterator()]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("queue_url", ["sentinel"], indirect=True)
def test_ten_failovers_lose_nothing_and_restart_nothing(
    queue_url: str,
    queue_name: str,
    redis_sentinel: Any,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=5)
    producers = [spawn_proc(serve_argv("--hwm", "4"), env=env) for _ in range(2)]
    out, stop, figures = tmp_path / "out.jsonl", tmp_path / "stop", tmp_path / "figures.json"
    trainer = spawn_proc(
        train_argv(queue_url, queue_name, out, 1, "--until", str(stop), "--figures",
                   str(figures), "--finish")
    )  # fmt: skip
    wait_until(lambda: len(lines(out)) >= 40, timeout_s=60, what="the trainer's first epoch")
    done = []
    for i in range(FAILOVERS):
        before = len(lines(out))
        failover = redis_sentinel.failover(kill=i % 2 == 1)
        # Batches built after the failover reach the trainer: more than its look-ahead.
        wait_until(lambda n=before: len(lines(out)) >= n + 20, timeout_s=90,
                   what=f"the trainer reading after failover {i + 1}")  # fmt: skip
        done.append((failover, time.monotonic()))
        alive = [p.poll() is None for p in [*producers, trainer]]
        assert all(alive), f"a process ended at failover {i + 1}: {alive}"
    stop.touch()
    assert trainer.wait(timeout=120) == 0
    for proc in producers:  # the trainer finished the run: they exit by themselves
        assert proc.wait(timeout=30) == 0
    got = lines(out)
    epochs = got[-1][0] + 1
    assert got == reference(epochs)  # every epoch exact, in plan order
    figs = json.loads(figures.read_text())
    print(f"\n{FAILOVERS} failovers, {epochs} epochs, {len(got)} batches; trainer: {figs}")
    for n, (f, _) in enumerate(done, start=1):
        how = "kill -9" if f.kill else "SENTINEL FAILOVER"
        drained = "-" if f.drained_s is None else f"{f.drained_s:.2f} s"
        print(f"  {n:2d} {how:17s} new master named in {f.switch_s:.2f} s, clients off the "
              f"old one in {drained}, replica back in {f.ready_s:.2f} s")  # fmt: skip
