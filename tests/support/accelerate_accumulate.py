"""Accelerate's gradient accumulation over a TorchStream and over a prepared DataLoader
of the same batches, in one process (CPU).

Run as ``accelerate_accumulate.py URL QUEUE EXAMPLES BATCH EPOCHS OUT``: writes to OUT a
JSON object with, for the stream and for the DataLoader, one list per epoch of
[example indices, sync_gradients] per batch, as ``accumulate()`` set them
(gradient_accumulation_steps=3), and the optimiser steps each made.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import Any

import torch
from accelerate import Accelerator
from pipelines import examples_of, numbered

from consumer import ServerDataStream
from consumer.torch import TorchStream


def train(accelerator: Accelerator, batches: Any, epochs: int, take: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = accelerator.prepare(model, opt)
    seen, steps = [], 0
    for _ in range(epochs):
        epoch = []
        for batch in batches() if callable(batches) else batches:
            features = take(batch)
            with accelerator.accumulate(model):
                accelerator.backward(model(features.float() / 1000).mean())
                epoch.append([examples_of(features.numpy()), accelerator.sync_gradients])
                steps += accelerator.sync_gradients
                opt.step()
                opt.zero_grad()
        seen.append(epoch)
    return {"epochs": seen, "steps": steps}


def main() -> int:
    url, queue, examples, batch, epochs, out = sys.argv[1:7]
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    ts = TorchStream(ServerDataStream(("features", "targets"), url=url, queue=queue))
    ts = accelerator.prepare(ts)
    got = {"stream": train(accelerator, ts, int(epochs), lambda b: b[0])}
    ts.close(finished=True)
    plan: Iterable[Any] = [
        torch.from_numpy(f) for f, _ in numbered(int(examples), int(batch)).get_epoch_iterator()
    ]
    loader = accelerator.prepare(torch.utils.data.DataLoader(list(plan), batch_size=None))
    got["loader"] = train(accelerator, loader, int(epochs), lambda b: b)
    with open(out, "w") as f:
        json.dump(got, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
