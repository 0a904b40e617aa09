"""Accelerate (CPU, gloo, 2 ranks from torchrun's variables) around a TorchStream: its
DataLoaderDispatcher, which would read on rank 0 only, is refused on every rank in
``prepare()``; a plain DataLoader on every rank reads each rank's share exactly."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from pipelines import examples_of, numbered

pytest.importorskip("torch")
pytest.importorskip("accelerate")

SUPPORT = Path(__file__).resolve().parents[1] / "support"
EXAMPLES, BATCH, WORLD = 200, 10, 2  # 20 batches (one per shard) per epoch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_dispatcher_refused_on_every_rank_and_plain_loaders_read_every_share(
    redis_url: str,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    spawn_proc(serve_argv("--hwm", "4"), env=serve_env(examples=EXAMPLES, batch_size=BATCH))
    port = free_port()
    outs = [tmp_path / f"r{r}.json" for r in range(WORLD)]
    ranks = []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
        env.update(LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.update(OMP_NUM_THREADS="1")
        argv = [sys.executable, str(SUPPORT / "accelerate_rank.py"), redis_url, queue_name]
        ranks.append(spawn_proc([*argv, str(outs[rank])], env=env))
    assert [proc.wait(timeout=120) for proc in ranks] == [0] * WORLD
    got = [json.loads(out.read_text()) for out in outs]
    assert [(g["rank"], g["world"]) for g in got] == [(r, WORLD) for r in range(WORLD)]
    for g in got:
        assert "DataLoaderDispatcher" in g["refused"]
        assert "pass the stream itself to accelerator.prepare()" in g["refused"]
    plan = [examples_of(f) for f, _ in numbered(EXAMPLES, BATCH).get_epoch_iterator()]
    for rank, g in enumerate(got):
        assert g["batches"] == plan[rank::WORLD]  # its share, in plan order, nothing lost
