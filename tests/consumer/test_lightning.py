"""Lightning (2 CPU ranks, ``strategy='ddp'``) trained from a TorchStream, killed
mid-epoch and resumed with ``fit(ckpt_path=...)`` from the checkpoint Lightning keeps
(rank 0's state only): every rank's batches, kept steps before the checkpoint then the
resumed run's, are exactly its share of every epoch in plan order."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from pipelines import examples_of, numbered

pytest.importorskip("torch")
if importlib.util.find_spec("lightning") is None:  # not imported here: it imports torchvision
    pytest.skip("needs lightning (the test extra)", allow_module_level=True)

SUPPORT = Path(__file__).resolve().parents[1] / "support"
EXAMPLES, BATCH, WORLD, EPOCHS = 200, 10, 2, 2  # 10 steps an epoch on each rank
STOP, SAVED = 7, 6  # killed after step 7; Lightning's last checkpoint is of step 6


def steps(out: Path, rank: int) -> list[tuple[int, int, list[int]]]:
    """What a rank trained on: (global step, epoch, example indices) per step."""
    text = (out / f"rank{rank}.jsonl").read_text()
    return [tuple(json.loads(line)) for line in text.splitlines()]  # type: ignore[misc]


def test_ddp_killed_mid_epoch_resumes_exactly_from_rank_zeros_checkpoint(
    redis_url: str,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH)
    spawn_proc(serve_argv("--hwm", "4"), env=env)
    job = [sys.executable, str(SUPPORT / "lightning_job.py"), redis_url, queue_name]
    job += [str(tmp_path), str(EPOCHS)]
    env["OMP_NUM_THREADS"] = "1"
    assert spawn_proc([*job, "--stop-at", str(STOP)], env=env).wait(timeout=120) == 3
    first = [steps(tmp_path, r) for r in range(WORLD)]
    assert [len(f) for f in first] == [STOP] * WORLD
    resumed = spawn_proc([*job, "--resume", str(tmp_path / "last.ckpt")], env=env)
    assert resumed.wait(timeout=120) == 0
    stream = numbered(EXAMPLES, BATCH)
    plans = [[examples_of(f) for f, _ in stream.get_epoch_iterator()] for _ in range(EPOCHS)]
    for rank in range(WORLD):
        trained = [s for s in steps(tmp_path, rank)[:STOP] if s[0] < SAVED]
        trained += steps(tmp_path, rank)[STOP:]
        assert [s[0] for s in trained] == list(range(EPOCHS * len(plans[0]) // WORLD))
        for epoch, plan in enumerate(plans):
            assert [s[2] for s in trained if s[1] == epoch] == plan[rank::WORLD]


def test_hooks_asked_again_read_on_in_the_same_run(
    redis_url: str,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    # reload_dataloaders_every_n_epochs=1, validate() after fit() and a second fit():
    # each makes a new stream while the earlier one still held the queue (its reader
    # refreshes the claim), which raised TrainerConflict. One standing between two
    # epochs is taken over: the new stream reads on at the next epoch of the run.
    val_queue = f"{queue_name}-val"
    spawn_proc(serve_argv("--hwm", "4"), env=serve_env(examples=50, batch_size=10, seed=1))
    val_argv = serve_argv("--hwm", "4")
    val_argv[val_argv.index("--queue") + 1] = val_queue
    spawn_proc(val_argv, env=serve_env(examples=50, batch_size=10, seed=7))
    out = tmp_path / "hooks.json"
    job = [sys.executable, str(SUPPORT / "lightning_hooks.py"), redis_url, queue_name]
    env = serve_env()
    env["OMP_NUM_THREADS"] = "1"
    assert spawn_proc([*job, val_queue, str(out)], env=env).wait(timeout=180) == 0
    got = json.loads(out.read_text())
    train, val = numbered(50, 10, seed=1), numbered(50, 10, seed=7)
    epochs = [[examples_of(f) for f, _ in train.get_epoch_iterator()] for _ in range(3)]
    assert got["trained"] == [[e, b] for e, batches in enumerate(epochs) for b in batches]
    # A validation epoch in each fit epoch (2, then 1) and one of validate(): 4, in order.
    val_epochs = [[examples_of(f) for f, _ in val.get_epoch_iterator()] for _ in range(4)]
    assert got["validated"] == [b for batches in val_epochs for b in batches]
