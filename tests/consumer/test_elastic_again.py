"""Checkpoints taken inside a re-split epoch: a job of R ranks resumed by R' ranks, which
checkpoint before the re-split epoch ends, resumed again by the same R' ranks or by yet
another number R'', every epoch exact (plus the documented pads)."""

from __future__ import annotations

import json
import signal
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from data_parallel import (
    BATCH,
    EXAMPLES,
    check_epoch,
    checkpoint_ranks,
    plans,
    shares,
    spawn_ranks,
)
from pipelines import examples_of
from train import lines
from waiting import wait_until

from batchq.host.embedded import EmbeddedRedis
from consumer import ServerDataStream

OLD, STOP, EPOCHS = 4, 3, 2  # the first job: 4 ranks, 3 batches each of epoch 0


@pytest.fixture
def producers(spawn_proc: Any, serve_argv: Any, serve_env: Any) -> Any:
    """``n`` producer processes, 20 ms a batch (a kill lands inside an epoch)."""

    def start(n: int, *extra: str) -> list[Any]:
        argv = serve_argv("--hwm", "4", "--heartbeat-ttl-s", "2", *extra)
        env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=20)
        return [spawn_proc(argv, env=env) for _ in range(n)]

    return start


def resplit(units: list[list[int]], world: int) -> list[list[list[int]]]:
    """Each rank's share of ``units`` re-split: unit u to rank u % world, pads repeating
    the first units up to equal counts."""
    per = -(-len(units) // world)
    padded = units + units[: per * world - len(units)]
    return [padded[r::world] for r in range(world)]


def resume_then_stop(
    spawn_proc: Any, url: str, queue: str, tmp: Path, states: Path, world: int, stop: int
) -> tuple[list[Path], Path]:
    """``world`` ranks resuming ``states`` that read ``stop`` batches each, saving their
    states (inside the re-split epoch), then stop; their outputs and the states' file."""
    outs = [tmp / f"b{r}.jsonl" for r in range(world)]
    saved = [tmp / f"t{r}.json" for r in range(world)]
    procs = spawn_ranks(
        spawn_proc, url, queue, outs, EPOCHS, "--state-in", str(states),
        "--stop-after", str(stop), per_rank=lambda r: ["--state-out", str(saved[r])],
    )  # fmt: skip
    for proc in procs:
        assert proc.wait(timeout=60) == 3
    both = tmp / "again.json"
    both.write_text(json.dumps([json.loads(s.read_text()) for s in saved]))
    return outs, both


def first_job(spawn_proc: Any, url: str, queue: str, tmp: Path) -> tuple[list[Path], Path]:
    """The first job's ranks, checkpointed inside epoch 0; their outputs and states."""
    outs, saved = checkpoint_ranks(spawn_proc, url, queue, tmp, EPOCHS, OLD, STOP)
    states = tmp / "all.json"
    states.write_text(json.dumps(saved))
    return outs, states


@pytest.mark.parametrize("stripes", [1, 2])
def test_same_ranks_resume_inside_the_resplit_epoch(
    redis_url: str,
    queue_name: str,
    producers: Any,
    spawn_proc: Any,
    tmp_path: Path,
    stripes: int,
) -> None:
    procs = producers(2, "--stripes", str(stripes))
    new, stop = 2, 2
    outs_a, states = first_job(spawn_proc, redis_url, queue_name, tmp_path)
    outs_b, again = resume_then_stop(spawn_proc, redis_url, queue_name, tmp_path, states, new, stop)
    outs_c = [tmp_path / f"c{r}.jsonl" for r in range(new)]
    last = spawn_ranks(
        spawn_proc, redis_url, queue_name, outs_c, EPOCHS, "--finish", "--state-in", str(again)
    )
    # A producer killed while the rest of the re-split epoch is built (as a rule): the
    # other rebuilds its leases, a remapped slot as remapped.
    wait_until(lambda: any(lines(o) for o in outs_c), timeout_s=60, what="resumed batches")
    procs[0].send_signal(signal.SIGKILL)
    for proc in last:
        assert proc.wait(timeout=90) == 0
    plan = plans(EPOCHS)
    before = [b for o in outs_a for _, b in lines(o)]
    assert before == [b for r in range(OLD) for b in plan[0][r : OLD * STOP : OLD]]
    shares_b, shares_c = shares(outs_b, EPOCHS), shares(outs_c, EPOCHS)
    assert shares_b[1] == [[]] * new  # the second job stopped inside the re-split epoch
    units = plan[0][OLD * STOP :]
    # Each rank's share of the re-split epoch: before its checkpoint, then after it.
    assert [b + c for b, c in zip(shares_b[0], shares_c[0], strict=True)] == resplit(units, new)
    got = Counter(tuple(b) for b in before + [b for s in shares_b[0] + shares_c[0] for b in s])
    pads = [b for s in resplit(units, new) for b in s][len(units) :]
    assert got == Counter(tuple(b) for b in plan[0] + pads)
    check_epoch(plan[1], shares_c[1], new)


def test_another_world_resumes_inside_the_resplit_epoch(
    redis_url: str, queue_name: str, producers: Any, spawn_proc: Any, tmp_path: Path
) -> None:
    producers(2)
    new, stop, newer = 3, 2, 2
    outs_a, states = first_job(spawn_proc, redis_url, queue_name, tmp_path)
    outs_b, again = resume_then_stop(spawn_proc, redis_url, queue_name, tmp_path, states, new, stop)
    outs_c = [tmp_path / f"c{r}.jsonl" for r in range(newer)]
    last = spawn_ranks(
        spawn_proc, redis_url, queue_name, outs_c, EPOCHS, "--finish", "--state-in", str(again)
    )
    for proc in last:
        assert proc.wait(timeout=90) == 0
    plan = plans(EPOCHS)
    before = [b for o in outs_a for _, b in lines(o)]
    units = plan[0][OLD * STOP :]
    # The second job yielded the first `stop` slots of each rank: units 0 .. new*stop-1.
    shares_b = shares(outs_b, EPOCHS)
    assert shares_b[0] == [s[:stop] for s in resplit(units, new)]
    # The rest, re-split again: the units none yielded (the second job's pads go).
    rest = units[new * stop :]
    shares_c = shares(outs_c, EPOCHS)
    assert shares_c[0] == resplit(rest, newer)
    yielded = before + [b for s in shares_b[0] + shares_c[0] for b in s]
    pads = [b for s in resplit(rest, newer) for b in s][len(rest) :]
    assert Counter(tuple(b) for b in yielded) == Counter(tuple(b) for b in plan[0] + pads)
    check_epoch(plan[1], shares_c[1], newer)


def test_redis_lost_inside_the_resplit_epoch_rebuilds_the_remapped_slots(
    tmp_path: Path, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    server = EmbeddedRedis(workdir=str(tmp_path / "redis"))
    server.start()
    try:
        argv = serve_argv("--hwm", "4", "--heartbeat-ttl-s", "2")
        argv[argv.index("--url") + 1] = server.url
        env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=2)
        for _ in range(2):
            spawn_proc(argv, env=env)
        # The first job: 4 ranks, 1 batch each; 18 units left, 9 for each of 2 ranks.
        outs, saved = checkpoint_ranks(spawn_proc, server.url, queue_name, tmp_path, 2, OLD, 1)
        new, before_loss = 2, 2
        got: list[list[tuple[int, list[int]]]] = [[] for _ in range(new)]
        reached = [threading.Event() for _ in range(new)]
        lost, errors = threading.Event(), []

        def rank(r: int) -> None:
            try:
                with ServerDataStream(
                    ("features", "targets"), url=server.url, queue=queue_name, rank=r,
                    world_size=new, stall_s=1.0, timeout_s=60,
                ) as stream:  # fmt: skip
                    stream.load_state_dict(saved)
                    for _ in range(EPOCHS):
                        for f, _ in stream.get_epoch_iterator():
                            got[r].append((stream.epoch, examples_of(f)))
                            if len(got[r]) == before_loss:
                                reached[r].set()  # the rest of its share not all here yet
                                assert lost.wait(timeout=60)
                    stream.close(finished=True)
            except BaseException as e:
                errors.append(e)
                reached[r].set()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(new)]
        for t in threads:
            t.start()
        for event in reached:
            assert event.wait(timeout=60)
        server.kill()
        server.restart(wipe=True)  # the remap hash and the ledger go with the queue
        lost.set()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        plan = plans(EPOCHS)
        after = [[[b for ep, b in g if ep == e] for g in got] for e in range(EPOCHS)]
        assert [b for o in outs for _, b in lines(o)] == plan[0][:OLD]
        assert after[0] == resplit(plan[0][OLD:], new)  # 18 units: no pads
        check_epoch(plan[1], after[1], new)
    finally:
        server.stop()
