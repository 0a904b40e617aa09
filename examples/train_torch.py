"""Train a small CNN in PyTorch on batches served by batchq, with checkpoints.

Producers (as many as you like, on any host)::

    batchq serve examples.train_torch:make_stream --queue digits --arg seed=3

The trainer::

    python -m examples.train_torch --queue digits --epochs 5 --checkpoint ckpt.pt

Run the trainer again with the same ``--checkpoint`` after stopping it (even with
SIGKILL between checkpoints) and it resumes at the saved batch: the model, the
optimiser and the loader's position are saved together, every ``--save-every``
batches and at each epoch's end.

The data are synthetic 1 x 16 x 16 "digits" (each class a fixed pattern plus noise),
so the example needs nothing beyond numpy and torch; the producers normalise with
numpy (float64), and the trainer declares float32: batchq casts on its reader thread.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from consumer import ServerDataStream
from consumer.torch import TorchStream
from producer.datasets import IndexableDataset
from producer.schemes import ShuffledScheme
from producer.streams import DataStream
from producer.transformers import ScaleAndShift

__all__ = ["Net", "main", "make_stream", "synthetic_digits"]

CLASSES, SIDE = 10, 16


def synthetic_digits(examples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``examples`` images (uint8, N x 1 x 16 x 16) and their labels (int64)."""
    rng = np.random.default_rng(seed)
    patterns = np.random.default_rng(1234).random((CLASSES, 1, SIDE, SIDE)) > 0.5
    labels = rng.integers(0, CLASSES, examples)
    noise = rng.integers(0, 96, (examples, 1, SIDE, SIDE))
    images = (patterns[labels] * 160 + noise).astype(np.uint8)
    return images, labels.astype(np.int64)


def make_stream(seed: int = 0, examples: int = 2000, batch_size: int = 64) -> Any:
    """The producers' pipeline (``batchq serve ... --arg seed=3 --arg batch_size=128``)."""
    images, labels = synthetic_digits(examples, seed)
    dataset = IndexableDataset({"images": images, "labels": labels})
    scheme = ShuffledScheme(examples=examples, batch_size=batch_size, rng=seed)
    stream = DataStream.default_stream(dataset, iteration_scheme=scheme)
    # Normalised with numpy statistics: float64, which the trainer casts to float32.
    mean, std = float(images.mean()), float(images.std())
    return ScaleAndShift(stream, 1 / std, -mean / std, which_sources=("images",))


class Net(nn.Module):
    """A small CNN for 1 x 16 x 16 images."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 4 * 4, CLASSES),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def save(path: str, model: nn.Module, opt: torch.optim.Optimizer, ts: TorchStream) -> None:
    """Model, optimiser and the loader's position, together and atomically."""
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "data": ts.state_dict()}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def main(argv: Sequence[str] | None = None) -> int:
    """Train ``--epochs`` epochs from the queue; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="Redis URL (default: BATCHQ_URL, localhost)")
    p.add_argument("--queue", default="digits")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--checkpoint", default=None, help="save to / resume from this file")
    p.add_argument("--save-every", type=int, default=20, help="batches between checkpoints")
    p.add_argument("--finish", action="store_true", help="end the run: producers exit 0")
    args = p.parse_args(argv)

    stream = ServerDataStream(("images", "labels"), False, url=args.url, queue=args.queue)
    ts = TorchStream(stream, device=args.device, dtypes={"images": torch.float32})
    model = Net().to(args.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if args.checkpoint and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, map_location=args.device)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        ts.load_state_dict(saved["data"])
        print(f"resumed at epoch {saved['data'].get('epoch', 0)}", flush=True)
    loss_fn = nn.CrossEntropyLoss()
    with ts:
        while stream.epoch + 1 < args.epochs:
            correct = seen = 0
            for step, (images, labels) in enumerate(ts):
                opt.zero_grad()
                logits = model(images)
                loss = loss_fn(logits, labels)
                loss.backward()
                opt.step()
                correct += int((logits.argmax(1) == labels).sum())
                seen += len(labels)
                if args.checkpoint and (step + 1) % args.save_every == 0:
                    save(args.checkpoint, model, opt, ts)
            if args.checkpoint:
                save(args.checkpoint, model, opt, ts)
            print(f"epoch {stream.epoch}: accuracy {correct / max(seen, 1):.3f}", flush=True)
        if args.finish:
            ts.close(finished=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
