"""torch.distributed (gloo, CPU): two DDP ranks trained from one queue, then resumed."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
WORLD, EPOCHS, PER_RANK = 2, 3, 10  # 640 examples in batches of 32: 20 per epoch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(spawn_proc: Any, url: str, queue: str, tmp: Path, *extra: str) -> list[int]:
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        argv = [sys.executable, "-m", "examples.train_ddp", "--url", url, "--queue", queue]
        argv += ["--epochs", str(EPOCHS), "--checkpoint", str(tmp / "ckpt")]
        argv += ["--save-every", "4", "--out", str(tmp / f"out{rank}.json"), *extra]
        procs.append(spawn_proc(argv, env=env, cwd=str(ROOT)))
    return [p.wait(timeout=240) for p in procs]


def test_ddp_trains_three_epochs_and_resumes_mid_epoch(
    redis_url: str, queue_name: str, spawn_proc: Any, tmp_path: Path
) -> None:
    for _ in range(2):
        argv = [sys.executable, "-m", "batchq.cli", "--log-level", "WARNING", "serve"]
        argv += ["examples.train_torch:make_stream", "--url", redis_url, "--queue", queue_name]
        argv += ["--arg", "examples=640", "--arg", "batch_size=32", "--arg", "seed=3"]
        spawn_proc(argv, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=str(ROOT))
    # Stopped at step 14 (epoch 1), after the checkpoint of step 12.
    assert run_ranks(spawn_proc, redis_url, queue_name, tmp_path, "--stop-after", "14") == [3, 3]
    saved = sorted(tmp_path.glob("ckpt.rank*.pt"))
    assert len(saved) == WORLD
    assert run_ranks(spawn_proc, redis_url, queue_name, tmp_path, "--finish") == [0, 0]
    outs = [json.loads((tmp_path / f"out{r}.json").read_text()) for r in range(WORLD)]
    # The rest of epoch 1 from step 12, then epoch 2: the same steps on both ranks.
    assert [o["per_epoch"] for o in outs] == [[PER_RANK - 2, PER_RANK]] * WORLD
    assert outs[0]["params"] == outs[1]["params"]  # DDP kept the replicas identical
