"""The ranks of a data-parallel job as the tests run them: trainer processes
(``train.py``), one per rank, and the checks of what they yielded: every epoch split
slot by slot, equal counts, exact; and an elastic resume (R ranks checkpointed, R' ranks
resumed from all of their states) exact too."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipelines import examples_of, numbered
from train import argv as train_argv
from train import lines

from consumer import ServerDataStream

EXAMPLES, BATCH = 220, 10  # 22 batches (one per shard) per epoch: 4 ranks need 2 pads


def plans(epochs: int) -> list[list[list[int]]]:
    """The in-process batches of each epoch, in plan order."""
    stream = numbered(EXAMPLES, BATCH)
    return [[examples_of(f) for f, _ in stream.get_epoch_iterator()] for _ in range(epochs)]


def rank_argv(
    url: str, queue: str, out: Path, epochs: int, rank: int, world: int, *extra: str
) -> list[str]:
    return train_argv(url, queue, out, epochs, "--rank", str(rank), "--world", str(world), *extra)


def spawn_ranks(
    spawn_proc: Any,
    url: str,
    queue: str,
    outs: list[Path],
    epochs: int,
    *extra: str,
    per_rank: Callable[[int], list[str]] = lambda r: [],
) -> list[Any]:
    """One trainer process per rank (as many as ``outs``), each writing to its own file."""
    world = len(outs)
    return [
        spawn_proc(rank_argv(url, queue, outs[r], epochs, r, world, *extra, *per_rank(r)))
        for r in range(world)
    ]  # fmt: skip


def checkpoint_ranks(
    spawn_proc: Any,
    url: str,
    queue: str,
    tmp: Path,
    epochs: int,
    world: int,
    stop: int,
    *extra: str,
) -> tuple[list[Path], list[dict[str, Any]]]:
    """Ranks that read ``stop`` batches each, saving their states, then stop (``extra``:
    more of train.py's arguments, for every rank)."""
    outs = [tmp / f"a{r}.jsonl" for r in range(world)]
    states = [tmp / f"s{r}.json" for r in range(world)]
    procs = spawn_ranks(
        spawn_proc, url, queue, outs, epochs, "--stop-after", str(stop), *extra,
        per_rank=lambda r: ["--state-out", str(states[r])],
    )  # fmt: skip
    for proc in procs:
        assert proc.wait(timeout=60) == 3
    return outs, [json.loads(s.read_text()) for s in states]


def shares(outs: list[Path], epochs: int) -> list[list[list[list[int]]]]:
    """shares[epoch][rank] = the batches that rank yielded in that epoch, in order."""
    got = [lines(o) for o in outs]
    return [[[b for ep, b in g if ep == e] for g in got] for e in range(epochs)]


def check_epoch(plan: list[list[int]], per_rank: list[list[list[int]]], world: int) -> None:
    """Equal counts, the plan split slot by slot, pads being the epoch's first batches."""
    per = -(-len(plan) // world)
    assert [len(s) for s in per_rank] == [per] * world
    slots = plan + plan[: per * world - len(plan)]
    for r, share in enumerate(per_rank):
        assert share == slots[r::world]  # disjoint, in plan order
    together = Counter(tuple(b) for s in per_rank for b in s)
    assert set(together) == {tuple(b) for b in plan}  # every batch of the epoch


def elastic_restart(
    spawn_proc: Any, url: str, queue: str, tmp: Path, epochs: int, old: int, new: int, stop: int
) -> tuple[list[Path], list[Path], list[Any]]:
    """``old`` ranks read ``stop`` batches each and save their states; ``new`` ranks are
    started from all of them (the last one's close finishes the run).

    Returns:
        (the first job's outputs, the second job's, the second job's processes).
    """
    outs, saved = checkpoint_ranks(spawn_proc, url, queue, tmp, epochs, old, stop)
    (tmp / "all.json").write_text(json.dumps(saved))
    outs_b = [tmp / f"b{r}.jsonl" for r in range(new)]
    second = spawn_ranks(
        spawn_proc, url, queue, outs_b, epochs, "--finish", "--state-in", str(tmp / "all.json")
    )
    return outs, outs_b, second


def check_elastic_resume(
    outs: list[Path], outs_b: list[Path], epochs: int, old: int, new: int, stop: int
) -> None:
    """What :func:`elastic_restart`'s two jobs yielded: all of epoch 0 exactly once (plus
    the documented pads), its rest re-split among the ``new`` ranks, every later epoch
    split exactly."""
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


def two_ranks_in_epoch_2() -> list[dict[str, Any]]:
    """Both states of a 2-rank checkpoint taken in epoch 2 (S = 6 one-batch shards,
    local shard 0 done on each): what the unit tests re-split for 3 ranks."""
    return [
        {"version": 1, "queue": "q", "run": "r", "fingerprint": "f", "shards": 3,
         "plan_shards": 6, "epoch": 2, "consumed": {}, "done": [0], "rank": r,
         "world_size": 2, "even_batches": "pad", "step": 6}
        for r in range(2)
    ]  # fmt: skip


def lockstep(
    url: str, queue: str, world: int, epochs: int, even: str, state: Any = None
) -> list[list[tuple[int, list[int]]]]:
    """``world`` ranks (threads of this process) that step together as DDP's do: a
    barrier after every batch and at every epoch's end; each loads ``state`` first."""
    return ranks_in_step(url, queue, world, epochs, even, state)[0]


def ranks_in_step(
    url: str,
    queue: str,
    world: int,
    epochs: int,
    even: str,
    state: Any = None,
    *,
    stop: int | None = None,
    every_batch: bool = True,
    group: str | None = None,
) -> tuple[list[list[tuple[int, list[int]]]], dict[str, Any] | None]:
    """:func:`lockstep`'s ranks (``every_batch``: a barrier after every batch, else only
    at ``stop``; of ``group``, None: the default one); with ``stop`` each stops after
    that many batches, and once every rank is there rank 0's ``state_dict()`` is taken
    (what Lightning and Accelerate save) and every rank closes without finishing.

    Returns:
        (each rank's (epoch, examples) per batch, rank 0's state at ``stop`` or None).
    """
    barrier = threading.Barrier(world, timeout=30)
    got: list[list[tuple[int, list[int]]]] = [[] for _ in range(world)]
    errors: list[BaseException] = []
    saved: list[dict[str, Any]] = []

    def rank(r: int) -> None:
        try:
            with ServerDataStream(
                ("features", "targets"), url=url, queue=queue, rank=r, world_size=world,
                even_batches=even, timeout_s=30, group=group,
            ) as stream:  # fmt: skip
                if state is not None:
                    stream.load_state_dict(state)
                for _ in range(epochs):
                    for f, _ in stream.get_epoch_iterator():
                        got[r].append((stream.epoch, examples_of(f)))
                        if every_batch:
                            barrier.wait()
                        if len(got[r]) == stop:
                            barrier.wait()  # every rank is at the step
                            if r == 0:
                                saved.append(stream.state_dict())
                            barrier.wait()
                            return
                    barrier.wait()
        except BaseException as e:  # reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return got, saved[0] if saved else None
