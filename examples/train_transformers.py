"""The transformers Trainer fed by batchq, single process or DDP.

Producers::

    batchq serve examples.train_torch:make_stream --queue digits --workers 2

The trainer (one process, or ``torchrun --nproc-per-node 2 -m examples.train_transformers``)::

    python -m examples.train_transformers --queue digits --epochs 3
    python -m examples.train_transformers --queue digits --epochs 3 --resume   # after a stop

``get_train_dataloader()`` returns the stream: each rank reads its own share (its rank
found from the process group the Trainer starts). The stock one would wrap a DataLoader
in Accelerate's DataLoaderDispatcher, which reads on rank 0 only; batchq refuses that
(``DataLoaderDispatchError``) before the first step. ``TrainerCheckpoint`` keeps the
stream's state in each checkpoint (every 50 steps, under ``--output-dir``), so
``--resume`` (``train(resume_from_checkpoint=True)``) reads on exactly where the last
checkpoint was taken, on every rank.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from producer.torch import import_torchvision

import_torchvision()  # transformers imports torchvision: PyPI's beside the CPU torch

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from consumer import ServerDataStream  # noqa: E402
from consumer.torch import TorchStream, TrainerCheckpoint  # noqa: E402
from examples.train_torch import Net  # noqa: E402

__all__ = ["StreamTrainer", "main"]


class WithLoss(nn.Module):
    """The CNN, returning the loss the Trainer asks for."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        return {"loss": nn.functional.cross_entropy(self.net(images), labels)}


class StreamTrainer(Trainer):
    """The Trainer, fed by a TorchStream (yielding dicts: the model's keyword names)."""

    def __init__(self, *args: Any, stream: TorchStream, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stream = stream

    def get_train_dataloader(self) -> Any:
        return self.stream


def main(argv: Sequence[str] | None = None) -> int:
    """Train ``--epochs`` epochs; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="Redis URL (default: BATCHQ_URL, localhost)")
    p.add_argument("--queue", default="digits")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--output-dir", default="out-transformers")
    p.add_argument("--resume", action="store_true", help="from the last checkpoint")
    args = p.parse_args(argv)
    stream = ServerDataStream(("images", "labels"), url=args.url, queue=args.queue)
    ts = TorchStream(stream, as_dict=True, dtypes={"images": torch.float32})
    training = TrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        use_cpu=not torch.cuda.is_available(),
        report_to="none",
        learning_rate=0.05,
        save_steps=50,
    )
    trainer = StreamTrainer(
        model=WithLoss(), args=training, stream=ts, callbacks=[TrainerCheckpoint(ts)]
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    ts.close(finished=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
