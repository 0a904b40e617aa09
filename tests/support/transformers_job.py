"""The transformers Trainer (CPU ranks from torchrun's variables) trained from a
TorchStream returned by ``get_train_dataloader()``.

Run as ``transformers_job.py URL QUEUE OUT_DIR EPOCHS``. First a stream is given as
the Trainer's ``train_dataset`` and its own ``get_train_dataloader()`` runs (a
DataLoader that Accelerate's ``prepare`` wraps in its DataLoaderDispatcher, which reads
on rank 0 only): the error is written to ``OUT_DIR/refused<r>.txt``, and any step that
trained would be recorded. Then the job trains with ``get_train_dataloader()``
returning the stream; each rank appends [epoch, example indices] per training step to
``OUT_DIR/rank<r>.jsonl``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from pipelines import examples_of

from producer.torch import import_torchvision

import_torchvision()  # transformers imports torchvision: PyPI's beside the CPU torch

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from consumer import ServerDataStream  # noqa: E402
from consumer.torch import DataLoaderDispatchError, TorchStream  # noqa: E402


class Model(torch.nn.Module):
    """A linear model that records the examples of every training step."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.out = out
        self.epoch = 0

    def forward(self, features: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
        if self.training:
            with open(self.out, "a") as f:
                f.write(json.dumps([self.epoch, examples_of(features.numpy())]) + "\n")
        return {"loss": self.layer(features.float() / 1000).mean()}


class EpochMark(TrainerCallback):
    """Tells the model which epoch its steps belong to."""

    def __init__(self, model: Model) -> None:
        self.model = model

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.model.epoch = round(state.epoch or 0)


class StreamTrainer(Trainer):
    """The stock Trainer, fed by the stream (each rank reads its own share)."""

    stream: TorchStream

    def get_train_dataloader(self) -> Any:
        return self.stream if self.train_dataset is None else super().get_train_dataloader()


def main() -> int:
    url, queue, out_dir, epochs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    args = TrainingArguments(
        output_dir=out_dir,
        num_train_epochs=epochs,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        learning_rate=0.01,
    )
    rank = int(os.environ.get("RANK", "0"))
    model = Model(os.path.join(out_dir, f"rank{rank}.jsonl"))

    def stream() -> TorchStream:
        return TorchStream(
            ServerDataStream(("features", "targets"), url=url, queue=queue), as_dict=True
        )

    stock = StreamTrainer(model=model, args=args, train_dataset=stream())
    try:
        stock.train()
    except DataLoaderDispatchError as e:
        with open(os.path.join(out_dir, f"refused{rank}.txt"), "w") as f:
            f.write(str(e))
    trainer = StreamTrainer(model=model, args=args)
    trainer.stream = stream()
    trainer.add_callback(EpochMark(model))
    trainer.train()
    trainer.stream.close(finished=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
