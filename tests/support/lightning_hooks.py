"""A Lightning job (one CPU process) whose dataloader hooks make a new stream each time
Lightning asks: ``reload_dataloaders_every_n_epochs=1``, ``validate()`` after ``fit()``,
then a second ``fit()`` on the same Trainer for one more epoch.

Run as ``lightning_hooks.py URL QUEUE VAL_QUEUE OUT``: writes to OUT a JSON object with
the train batches ([epoch of the stream, example indices] per step) and the validation
batches (example indices per step, in order).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from pipelines import examples_of

from producer.torch import import_torchvision

import_torchvision()  # lightning imports torchvision: PyPI's beside the CPU torch

import lightning as L  # noqa: E402
import torch  # noqa: E402

from consumer import ServerDataStream  # noqa: E402
from consumer.torch import TorchStream  # noqa: E402


class Model(L.LightningModule):
    """A linear model recording what each step read; every hook makes a new stream."""

    def __init__(self, url: str, queue: str, val_queue: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.url, self.queue, self.val_queue = url, queue, val_queue
        self.train_streams: list[TorchStream] = []
        self.trained: list[tuple[int, list[int]]] = []
        self.validated: list[list[int]] = []

    def train_dataloader(self) -> Any:
        stream = ServerDataStream(("features", "targets"), url=self.url, queue=self.queue)
        self.train_streams.append(TorchStream(stream))
        return self.train_streams[-1]

    def val_dataloader(self) -> Any:
        return TorchStream(
            ServerDataStream(("features", "targets"), url=self.url, queue=self.val_queue)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        features, _ = batch
        self.trained.append((self.train_streams[-1].stream.epoch, examples_of(features.numpy())))
        return self.layer(features.float() / 1000).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.validated.append(examples_of(batch[0].numpy()))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> int:
    url, queue, val_queue, out = sys.argv[1:5]
    model = Model(url, queue, val_queue)
    options: dict[str, Any] = dict(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer = L.Trainer(max_epochs=2, reload_dataloaders_every_n_epochs=1, **options)
    trainer.fit(model)
    trainer.validate(model)
    trainer.fit_loop.max_epochs = 3
    trainer.fit(model)
    model.train_streams[-1].close(finished=True)
    with open(out, "w") as f:
        json.dump({"trained": model.trained, "validated": model.validated}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
