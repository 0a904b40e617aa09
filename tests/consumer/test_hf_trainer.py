"""The transformers Trainer on 2 CPU ranks (torchrun's variables) fed by a TorchStream:
the stock ``get_train_dataloader()`` (whose DataLoader Accelerate wraps in its
DataLoaderDispatcher, reading on rank 0 only) is refused on every rank before the first
step; ``get_train_dataloader()`` returning the stream trains every rank on exactly its
share of every epoch, also across a kill and ``train(resume_from_checkpoint=True)``
(``TrainerCheckpoint`` keeps the stream's state in the checkpoints, which rank 0
writes). One job does the refusal and the first run: the import of transformers is the
cost."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from pipelines import examples_of, numbered
from torchrun import SUPPORT, run_ranks

pytest.importorskip("torch")
if importlib.util.find_spec("transformers") is None:  # not imported: it imports torchvision
    pytest.skip("needs transformers (the test extra)", allow_module_level=True)

EXAMPLES, BATCH, WORLD, EPOCHS = 200, 10, 2, 2  # 10 steps an epoch on each rank
STOP, SAVED = 7, 6  # killed after step 7; the last checkpoint is of step 6


def lines(path: Path) -> list[tuple[int, list[int]]]:
    """What a rank trained on: (epoch, example indices) per step."""
    return [tuple(json.loads(line)) for line in path.read_text().splitlines()]  # type: ignore[misc]


def test_stock_dataloader_refused_and_the_stream_exact_on_every_rank_across_a_resume(
    redis_url: str,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    spawn_proc(serve_argv("--hwm", "4"), env=serve_env(examples=EXAMPLES, batch_size=BATCH))
    job = [str(SUPPORT / "transformers_job.py"), redis_url, queue_name, str(tmp_path), str(EPOCHS)]
    assert run_ranks(spawn_proc, [*job, "--stop-at", str(STOP)], WORLD) == [3] * WORLD
    first = [lines(tmp_path / f"rank{r}.jsonl") for r in range(WORLD)]
    assert [len(f) for f in first] == [STOP] * WORLD  # checkpoint-6 kept, step 7 lost
    assert (tmp_path / f"checkpoint-{SAVED}").is_dir()
    assert run_ranks(spawn_proc, [*job, "--resume"], WORLD) == [0] * WORLD
    stream = numbered(EXAMPLES, BATCH)
    plans = [[examples_of(f) for f, _ in stream.get_epoch_iterator()] for _ in range(EPOCHS)]
    for rank in range(WORLD):
        assert "DataLoaderDispatcher" in (tmp_path / f"refused{rank}.txt").read_text()
        trained = lines(tmp_path / f"rank{rank}.jsonl")  # the stock run trained nothing
        trained = trained[:SAVED] + trained[STOP:]
        for epoch, plan in enumerate(plans):
            assert [b for e, b in trained if e == epoch] == plan[rank::WORLD]
