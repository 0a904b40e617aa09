"""A Lightning job (2 CPU ranks, ``strategy='ddp'``) trained from a TorchStream.

Run as ``lightning_job.py URL QUEUE OUT_DIR EPOCHS [--stop-at N] [--resume CKPT]``:
Lightning's launcher starts the second rank (it sets no RANK: the stream finds its rank
in the process group Lightning initialises). Each rank appends one JSON line per
training step to ``OUT_DIR/rank<r>.jsonl``: [global step, epoch, example indices].
A checkpoint is kept every 3 steps (``OUT_DIR/last.ckpt``, with the stream's state:
Lightning saves rank 0's); ``--stop-at N`` ends both ranks at once after step N as a
kill would (``os._exit``, nothing closed); ``--resume`` resumes with
``fit(ckpt_path=...)``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from pipelines import examples_of
from torchrun import job_parser

from producer.torch import import_torchvision

import_torchvision()  # lightning imports torchvision: PyPI's beside the CPU torch

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from consumer import ServerDataStream  # noqa: E402
from consumer.torch import TorchStream  # noqa: E402


class Model(L.LightningModule):
    """A linear model whose every step records the examples it trained on."""

    def __init__(self, url: str, queue: str, out_dir: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.url, self.queue, self.out_dir = url, queue, out_dir
        self.stream: TorchStream | None = None

    def train_dataloader(self) -> Any:
        stream = ServerDataStream(("features", "targets"), url=self.url, queue=self.queue)
        self.stream = TorchStream(stream)
        return self.stream

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        features, _ = batch
        path = os.path.join(self.out_dir, f"rank{self.global_rank}.jsonl")
        with open(path, "a") as f:
            line = [self.global_step, self.current_epoch, examples_of(features.numpy())]
            f.write(json.dumps(line) + "\n")
        return self.layer(features.float() / 1000).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StopAt(Callback):
    """Ends the process after step N as a kill would: nothing closed or saved."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step >= self.step:
            sys.stdout.flush()
            os._exit(3)


def main() -> int:
    p = job_parser(resume_path=True)
    args = p.parse_args()
    model = Model(args.url, args.queue, args.out_dir)
    every = ModelCheckpoint(dirpath=args.out_dir, every_n_train_steps=3, save_last=True)
    callbacks: list[Callback] = [every]
    if args.stop_at is not None:
        callbacks.append(StopAt(args.stop_at))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=args.epochs,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, ckpt_path=args.resume)
    if model.stream is not None:
        model.stream.close(finished=args.stop_at is None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
