"""The transformers Trainer (CPU ranks from torchrun's variables) trained from a
TorchStream returned by ``get_train_dataloader()``.

Run as ``transformers_job.py URL QUEUE OUT_DIR EPOCHS [--stop-at N] [--resume]
[--accum A] [--save-steps S] [--max-steps M] [--no-stock]``.
First a stream is given as the Trainer's ``train_dataset`` and its own
``get_train_dataloader()`` runs (a DataLoader that Accelerate's ``prepare`` wraps in its
DataLoaderDispatcher, which reads on rank 0 only): the error is written to
``OUT_DIR/refused<r>.txt``, and any step that trained would be recorded. Then the job
trains with ``get_train_dataloader()`` returning the stream and ``TrainerCheckpoint``
keeping its state in the checkpoints (one every S steps, 3 unless told,
``OUT_DIR/checkpoint-<step>``), with ``gradient_accumulation_steps`` A (1 unless told);
each rank appends [epoch, example indices] per batch to ``OUT_DIR/rank<r>.jsonl``, and
[global_step, state.epoch, its batches as [epoch, example indices]] per optimizer step
to ``OUT_DIR/steps<r>.jsonl``. ``--max-steps`` is the Trainer's ``max_steps``;
``--no-stock`` leaves the stock part out.
``--stop-at N`` ends both ranks after step N as a kill would (``os._exit``, nothing
closed); ``--resume`` leaves the stock part out and resumes from the last checkpoint
(``train(resume_from_checkpoint=True)``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from pipelines import examples_of
from torchrun import job_parser

from producer.torch import import_torchvision

import_torchvision()  # transformers imports torchvision: PyPI's beside the CPU torch

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from consumer import ServerDataStream  # noqa: E402
from consumer.torch import DataLoaderDispatchError, TorchStream, TrainerCheckpoint  # noqa: E402


class Model(torch.nn.Module):
    """A linear model that records the examples of every training batch, and the epoch
    of the stream they came from (the Trainer's ``state.epoch`` is the fraction of the
    epochs its optimizer steps took in, not the epoch of a batch)."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.out = out
        self.stream: TorchStream | None = None
        self.batches: list[list[Any]] = []  # since the last optimizer step

    def forward(self, features: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
        if self.training and self.stream is not None:
            batch = [self.stream.stream.epoch, examples_of(features.numpy())]
            self.batches.append(batch)
            with open(self.out, "a") as f:
                f.write(json.dumps(batch) + "\n")
        return {"loss": self.layer(features.float() / 1000).mean()}


class StepLog(TrainerCallback):
    """Appends each optimizer step (global_step, state.epoch, its batches) to a file."""

    def __init__(self, model: Model, out: str) -> None:
        self.model = model
        self.out = out

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        with open(self.out, "a") as f:
            f.write(json.dumps([state.global_step, state.epoch, self.model.batches]) + "\n")
        self.model.batches = []


class StopAt(TrainerCallback):
    """Ends the process after step N as a kill would: nothing closed or saved."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step >= self.step:
            sys.stdout.flush()
            os._exit(3)


class StreamTrainer(Trainer):
    """The stock Trainer, fed by the stream (each rank reads its own share)."""

    stream: TorchStream

    def get_train_dataloader(self) -> Any:
        return self.stream if self.train_dataset is None else super().get_train_dataloader()


def main() -> int:
    parser = job_parser()
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--save-steps", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--no-stock", action="store_true")
    a = parser.parse_args()
    url, queue, out_dir = a.url, a.queue, a.out_dir
    args = TrainingArguments(
        output_dir=out_dir,
        num_train_epochs=a.epochs,
        max_steps=a.max_steps,
        gradient_accumulation_steps=a.accum,
        use_cpu=True,
        report_to="none",
        save_strategy="steps",
        save_steps=a.save_steps,
        save_only_model=False,
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

    if not (a.resume or a.no_stock):
        model.stream = stock_stream = stream()
        stock = StreamTrainer(model=model, args=args, train_dataset=stock_stream)
        try:
            stock.train()
        except DataLoaderDispatchError as e:
            with open(os.path.join(out_dir, f"refused{rank}.txt"), "w") as f:
                f.write(str(e))
    model.stream = ts = stream()
    model.batches = []
    steps = os.path.join(out_dir, f"steps{rank}.jsonl")
    callbacks: list[Any] = [TrainerCheckpoint(ts), StepLog(model, steps)]
    if a.stop_at is not None:
        callbacks.append(StopAt(a.stop_at))
    trainer = StreamTrainer(model=model, args=args, callbacks=callbacks)
    trainer.stream = ts
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    ts.close(finished=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
