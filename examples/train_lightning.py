"""PyTorch Lightning fed by batchq: train and validation streams, DDP, checkpoints.

Producers (any hosts; one queue for training, one for validation)::

    batchq serve examples.train_torch:make_stream --queue digits --workers 2 &
    batchq serve examples.train_torch:make_stream --queue digits-val --arg seed=7 &

The trainer (``--devices 2``: DDP on 2 CPU processes; Lightning starts the second)::

    python -m examples.train_lightning --queue digits --epochs 3 --devices 2 --ckpt-dir ckpt

Stopped at any point (even SIGKILL), run it again with ``--resume ckpt/last.ckpt``: it
resumes at the saved step. Each rank finds its rank in the process group Lightning
starts (nothing to pass), and the checkpoint Lightning writes (rank 0's) holds the
stream's position for every rank (docs/design.md, "One rank's state for every rank").
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from producer.torch import import_torchvision

import_torchvision()  # lightning imports torchvision: PyPI's wheel beside the CPU torch

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402

from consumer import ServerDataStream  # noqa: E402
from consumer.torch import TorchStream  # noqa: E402
from examples.train_torch import Net  # noqa: E402

__all__ = ["Digits", "main"]


class Digits(L.LightningModule):
    """The CNN of examples/train_torch.py, with its data from two queues."""

    def __init__(self, url: str | None, queue: str) -> None:
        super().__init__()
        self.net = Net()
        self.url, self.queue = url, queue
        self.streams: list[TorchStream] = []

    def _stream(self, queue: str) -> TorchStream:
        ts = TorchStream(
            ServerDataStream(("images", "labels"), url=self.url, queue=queue),
            dtypes={"images": torch.float32},
        )
        self.streams.append(ts)
        return ts

    def train_dataloader(self) -> Any:
        return self._stream(self.queue)  # this rank's share of every epoch

    def val_dataloader(self) -> Any:
        return self._stream(f"{self.queue}-val")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = nn.functional.cross_entropy(self.net(images), labels)
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        images, labels = batch
        accuracy = (self.net(images).argmax(1) == labels).float().mean()
        self.log("val_accuracy", accuracy, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main(argv: Sequence[str] | None = None) -> int:
    """Fit ``--epochs`` epochs; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="Redis URL (default: BATCHQ_URL, localhost)")
    p.add_argument("--queue", default="digits")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--ckpt-dir", default="ckpt-lightning")
    p.add_argument("--resume", default=None, help="a checkpoint to resume from")
    args = p.parse_args(argv)
    model = Digits(args.url, args.queue)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        num_sanity_val_steps=0,  # a sanity check would read part of a validation epoch
        callbacks=[ModelCheckpoint(args.ckpt_dir, every_n_train_steps=20, save_last=True)],
        logger=False,
    )
    trainer.fit(model, ckpt_path=args.resume)
    for ts in model.streams:
        ts.close(finished=True)  # the producers exit 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
