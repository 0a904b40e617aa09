"""Training frameworks fed by batchq against the same loops fed by torch's DataLoader.

One pipeline: a map-style dataset whose every example costs CPU to build (a seeded
3 x 32 x 32 image and a few passes of arithmetic over it, about ``--work-ms`` per
example), batches of 32, shuffled. Four loops train a small MLP on it for ``--epochs``
epochs in this process:

* ``plain``: a hand-written loop;
* ``lightning``: ``L.Trainer(accelerator='cpu', devices=1)``, the source returned by
  ``train_dataloader()``;
* ``accelerate``: ``Accelerator(cpu=True)``, model and optimiser prepared, the source
  iterated as it is (``accelerator.backward``);
* ``transformers``: the ``Trainer``, the source returned by ``get_train_dataloader()``.

Each loop is fed two ways, alternated within every repeat:

* ``loader``: ``DataLoader(dataset, batch_size=32, shuffle=True, num_workers=N,
  persistent_workers=True)`` in the trainer's process (the baseline);
* ``batchq``: ``batchq serve frameworks:make_loader --workers N`` (the same DataLoader,
  its dataset served by N producer processes, shared memory) into a ``TorchStream``.

Printed per loop and way: the median epoch time of epochs 2 and later (steady state;
epoch 1 includes starting the workers or producers, printed apart), and the ratio
batchq / loader of each loop (the issue's goal: at most 1.0). Figures are printed,
never asserted.

    python bench/frameworks.py [--url URL] [--workers 2] [--examples 2000] [--repeats 2]
        [--epochs 3] [--work-ms 0.3] [--loops plain,lightning,accelerate,transformers] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
sys.path.insert(0, REPO)

from batchq.host.embedded import url_or_embedded  # noqa: E402
from batchq.host.procs import spawn, stop_group  # noqa: E402
from consumer import ServerDataStream  # noqa: E402
from consumer.torch import TorchStream  # noqa: E402
from producer.torch import import_torchvision  # noqa: E402

LOOPS = ("plain", "lightning", "accelerate", "transformers")
WAYS = ("loader", "batchq")
BATCH = 32


class Costly(Dataset[tuple[torch.Tensor, int]]):
    """``n`` seeded images, each built with about ``work_ms`` of arithmetic."""

    def __init__(self, n: int, work_ms: float) -> None:
        self.n = n
        self.passes = max(1, round(work_ms / 0.03))  # one pass: about 30 us here

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = np.random.default_rng(i).standard_normal((3, 32, 32)).astype(np.float32)
        for _ in range(self.passes):
            x = np.tanh(x * 1.01)
        return torch.from_numpy(x), i % 10


def make_loader(examples: int = 2000, work_ms: float = 0.3, workers: int = 0) -> DataLoader[Any]:
    """The pipeline as a DataLoader (what ``batchq serve frameworks:make_loader`` serves)."""
    return DataLoader(
        Costly(int(examples), float(work_ms)),
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
        num_workers=int(workers),
        persistent_workers=int(workers) > 0,
    )


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )  # fmt: skip


class Clock:
    """Epoch start and end times, marked by whichever loop runs."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []
        self._start = 0.0

    def begin(self) -> None:
        self._start = time.perf_counter()

    def end(self) -> None:
        self.spans.append((self._start, time.perf_counter()))

    def seconds(self) -> list[float]:
        return [b - a for a, b in self.spans]


def _loss(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(net(x), y)


def run_plain(source: Iterable[Any], epochs: int, clock: Clock) -> None:
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for _ in range(epochs):
        clock.begin()
        for x, y in source:
            opt.zero_grad()
            _loss(net, x, y).backward()
            opt.step()
        clock.end()


def run_accelerate(source: Iterable[Any], epochs: int, clock: Clock) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    net, opt = accelerator.prepare(model(), torch.optim.SGD(model().parameters(), lr=0.01))
    for _ in range(epochs):
        clock.begin()
        for x, y in source:
            opt.zero_grad()
            accelerator.backward(_loss(net, x, y))
            opt.step()
        clock.end()


def run_lightning(source: Iterable[Any], epochs: int, clock: Clock) -> None:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model()

        def train_dataloader(self) -> Any:
            return source

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return _loss(self.net, *batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def on_train_epoch_start(self) -> None:
            clock.begin()

        def on_train_epoch_end(self) -> None:
            clock.end()

    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Module())


def run_transformers(source: Iterable[Any], epochs: int, clock: Clock) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model()

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": _loss(self.net, x, y)}

    class Fed(Trainer):
        def get_train_dataloader(self) -> Any:
            return source

        def _prepare_inputs(self, inputs: Any) -> Any:  # a (x, y) batch, as the loops'
            return {"x": inputs[0], "y": inputs[1]} if isinstance(inputs, list | tuple) else inputs

    class Marks(TrainerCallback):
        def on_epoch_begin(self, *args: Any, **kwargs: Any) -> None:
            clock.begin()

        def on_epoch_end(self, *args: Any, **kwargs: Any) -> None:
            clock.end()

    with tempfile.TemporaryDirectory(prefix="bench-hf-") as output_dir:  # saves nothing
        args = TrainingArguments(
            output_dir=output_dir, use_cpu=True, num_train_epochs=epochs, report_to="none",
            save_strategy="no", logging_strategy="no", disable_tqdm=True, learning_rate=0.01,
        )  # fmt: skip
        Fed(model=Net(), args=args, callbacks=[Marks()]).train()


RUNS: dict[str, Callable[[Iterable[Any], int, Clock], None]] = {
    "plain": run_plain,
    "lightning": run_lightning,
    "accelerate": run_accelerate,
    "transformers": run_transformers,
}


def feed(way: str, loop: str, url: str, args: argparse.Namespace) -> list[float]:
    """Run ``loop`` fed ``way``; its epochs' seconds."""
    clock = Clock()
    if way == "loader":
        loader = make_loader(args.examples, args.work_ms, args.workers)
        RUNS[loop](loader, args.epochs, clock)
        del loader  # its persistent workers stop with their iterator
        return clock.seconds()
    queue = f"bench-fw-{uuid.uuid4().hex[:8]}"
    argv = [sys.executable, "-m", "batchq.cli", "--log-level", "WARNING", "serve"]
    argv += ["frameworks:make_loader", "--url", url, "--queue", queue, "--hwm", "8"]
    argv += ["--workers", str(args.workers), "--arg", f"examples={args.examples}"]
    argv += ["--arg", f"work_ms={args.work_ms}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([BENCH_DIR, REPO]))
    proc = spawn(argv, env=env)
    try:
        stream = ServerDataStream(None, False, url=url, queue=queue, hwm=8, timeout_s=120)
        with TorchStream(stream) as ts:
            RUNS[loop](ts, args.epochs, clock)
            ts.close(finished=True)
        proc.wait(timeout=30)
    finally:
        stop_group(proc, timeout_s=5.0)
    return clock.seconds()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="Redis URL (default: an embedded server)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--examples", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--work-ms", type=float, default=0.3)
    p.add_argument("--loops", default=",".join(LOOPS))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    import_torchvision()  # lightning and transformers import torchvision
    loops = [name for name in args.loops.split(",") if name]
    seconds: dict[tuple[str, str], list[list[float]]] = {(lp, w): [] for lp in loops for w in WAYS}
    with url_or_embedded(args.url) as url:
        for r in range(args.repeats):
            for loop in loops:
                for way in WAYS if r % 2 == 0 else WAYS[::-1]:
                    took = feed(way, loop, url, args)
                    seconds[(loop, way)].append(took)
                    print(f"repeat {r + 1} {loop:12} {way:7} epochs " +
                          " ".join(f"{s:.2f}" for s in took), file=sys.stderr)  # fmt: skip
    out: dict[str, Any] = {}
    for loop in loops:
        row: dict[str, Any] = {}
        for way in WAYS:
            runs = seconds[(loop, way)]
            row[way] = {
                "epoch1_s": statistics.median(run[0] for run in runs),
                "epoch_s": statistics.median(s for run in runs for s in run[1:]),
            }
        row["ratio"] = row["batchq"]["epoch_s"] / row["loader"]["epoch_s"]
        row["ratio_epoch1"] = row["batchq"]["epoch1_s"] / row["loader"]["epoch1_s"]
        out[loop] = row
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{'loop':12} {'loader s/epoch':>15} {'batchq s/epoch':>15} {'ratio':>6} "
          f"{'epoch 1 (loader / batchq)':>27}")  # fmt: skip
    for loop, row in out.items():
        print(f"{loop:12} {row['loader']['epoch_s']:15.3f} {row['batchq']['epoch_s']:15.3f} "
              f"{row['ratio']:6.2f} {row['loader']['epoch1_s']:12.2f} / "
              f"{row['batchq']['epoch1_s']:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
