"""Accelerate (CPU, gloo, 2 ranks from torchrun's variables) around a TorchStream: its
DataLoaderDispatcher, which would read on rank 0 only, and its IterableDatasetShard
(dispatch_batches=False) are refused on every rank at the first batch; a plain
DataLoader on every rank reads each rank's share exactly; a job killed mid-epoch resumes
every rank from ``save_state`` (rank 0's copy), with shards of several batches and a
short last one (so the ranks' positions differ at one step)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from pipelines import examples_of, numbered, slot_shares
from torchrun import SUPPORT, run_ranks

pytest.importorskip("torch")
pytest.importorskip("accelerate")

EXAMPLES, BATCH, WORLD = 200, 10, 2  # 20 batches (one per shard) per epoch


def lines(path: Path) -> list[tuple[int, list[int]]]:
    """What a rank trained on: (epoch, example indices) per step."""
    return [tuple(json.loads(line)) for line in path.read_text().splitlines()]  # type: ignore[misc]


def test_dispatcher_refused_on_every_rank_and_plain_loaders_read_every_share(
    redis_url: str,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    spawn_proc(serve_argv("--hwm", "4"), env=serve_env(examples=EXAMPLES, batch_size=BATCH))
    outs = [tmp_path / f"r{r}.json" for r in range(WORLD)]
    job = [str(SUPPORT / "accelerate_rank.py"), redis_url, queue_name]
    assert run_ranks(spawn_proc, job, WORLD, lambda rank: [str(outs[rank])]) == [0] * WORLD
    got = [json.loads(out.read_text()) for out in outs]
    assert [(g["rank"], g["world"]) for g in got] == [(r, WORLD) for r in range(WORLD)]
    for g in got:
        assert "DataLoaderDispatcher" in g["refused"]
        assert "pass the stream itself to accelerator.prepare()" in g["refused"]
        assert "IterableDatasetShard" in g["shard_refused"]  # dispatch_batches=False
    plan = [examples_of(f) for f, _ in numbered(EXAMPLES, BATCH).get_epoch_iterator()]
    for rank, g in enumerate(got):
        assert g["batches"] == plan[rank::WORLD]  # its share, in plan order, nothing lost


def test_killed_mid_epoch_resumes_every_rank_from_save_state(
    redis_url: str,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    # register_for_checkpointing + save_state keep rank 0's state of the stream only.
    # Shards of 3 batches, the last of 2 (7 shards an epoch): rank 0 builds shards 0, 2,
    # 4, 6 (11 batches) and yields one run-time pad, rank 1 shards 1, 3, 5 and the pad
    # slot 7 (shard 0 again): 12 steps each. The state saved at step 6 (both ranks at
    # their third shard's start) is rank 0's alone; the plan's last shard is short, so
    # it carries the batches yielded of the epoch, from which rank 1's is rebuilt.
    env = serve_env(examples=EXAMPLES, batch_size=BATCH)
    spawn_proc(serve_argv("--hwm", "4", "--requests-per-shard", "3"), env=env)
    job = [str(SUPPORT / "accelerate_job.py"), redis_url, queue_name, str(tmp_path), "2"]
    assert run_ranks(spawn_proc, [*job, "--stop-at", "7"], WORLD) == [3] * WORLD
    first = [lines(tmp_path / f"rank{r}.jsonl") for r in range(WORLD)]
    assert [len(f) for f in first] == [7] * WORLD  # the state of step 6 was saved
    assert run_ranks(spawn_proc, [*job, "--resume"], WORLD) == [0] * WORLD
    stream = numbered(EXAMPLES, BATCH)
    plans = [[examples_of(f) for f, _ in stream.get_epoch_iterator()] for _ in range(2)]
    for epoch, plan in enumerate(plans):
        own = slot_shares(plan, 3, WORLD)  # rank 1's ends with its pad slot
        got = []
        for rank in range(WORLD):
            trained = lines(tmp_path / f"rank{rank}.jsonl")
            trained = trained[:6] + trained[7:]  # step 7 was lost with the kill
            got.append([b for e, b in trained if e == epoch])
        assert [len(g) for g in got] == [12] * WORLD  # DDP's equal steps: pads included
        assert got[1] == own[1]
        assert got[0][:11] == own[0]  # its share in plan order, then one run-time pad:
        # a batch it yielded before (its first of the epoch, or of the resumed run)
        assert got[0][11] == (own[0][0] if epoch else own[0][6])


def test_accumulate_syncs_at_each_epochs_end_as_over_a_prepared_dataloader(
    redis_url: str,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    # 10 batches an epoch, accumulation 3: a prepared DataLoader syncs after batches
    # 2, 5, 8 and 9 of each epoch. The stream did not tell Accelerate where an epoch
    # ends: it synced every 3 batches across epochs, and the run's last two batches
    # never reached an optimiser step.
    spawn_proc(serve_argv("--hwm", "4"), env=serve_env(examples=100, batch_size=BATCH))
    out = tmp_path / "accumulate.json"
    job = [str(SUPPORT / "accelerate_accumulate.py"), redis_url, queue_name, "100", "10"]
    done = spawn_proc([sys.executable, *job, "2", str(out)], env=serve_env())
    assert done.wait(timeout=120) == 0
    got = json.loads(out.read_text())
    for way in ("stream", "loader"):
        syncs = [[sync for _, sync in epoch] for epoch in got[way]["epochs"]]
        assert syncs == [[False, False, True] * 3 + [True]] * 2, way
        assert got[way]["steps"] == 8
    stream = numbered(100, BATCH)
    epochs = [[examples_of(f) for f, _ in stream.get_epoch_iterator()] for _ in range(2)]
    assert [[b for b, _ in epoch] for epoch in got["stream"]["epochs"]] == epochs
