"""Hugging Face Accelerate fed by batchq, single process or DDP, with checkpoints.

Producers::

    batchq serve examples.train_torch:make_stream --queue digits --workers 2

The trainer, one process or several (``accelerate launch`` or torchrun)::

    torchrun --nproc-per-node 2 -m examples.train_accelerate --queue digits --epochs 3 \\
        --state-dir state

The stream goes to ``accelerator.prepare`` as it is (returned untouched: each rank
reads its own share, its rank found from the process group). Do not prepare a
``DataLoader`` around it: Accelerate's DataLoaderDispatcher would read on rank 0 only,
and batchq refuses it (``DataLoaderDispatchError``). ``register_for_checkpointing``
puts the stream's position into ``save_state``; run the trainer again with the same
``--state-dir`` and every rank resumes there from the one saved state.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch
from accelerate import Accelerator
from torch import nn

from consumer import ServerDataStream
from consumer.torch import TorchStream
from examples.train_torch import Net

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Train ``--epochs`` epochs; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="Redis URL (default: BATCHQ_URL, localhost)")
    p.add_argument("--queue", default="digits")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--state-dir", default="state-accelerate")
    p.add_argument("--save-every", type=int, default=20, help="steps between save_state")
    args = p.parse_args(argv)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    stream = ServerDataStream(("images", "labels"), url=args.url, queue=args.queue)
    ts = TorchStream(stream, dtypes={"images": torch.float32}, device=accelerator.device)
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    net, opt, ts = accelerator.prepare(net, opt, ts)  # ts comes back as it is
    accelerator.register_for_checkpointing(ts)
    if os.path.isdir(args.state_dir):
        accelerator.load_state(args.state_dir)
    steps = 0
    while stream.epoch + 1 < args.epochs:
        for images, labels in ts:
            opt.zero_grad()
            accelerator.backward(nn.functional.cross_entropy(net(images), labels))
            opt.step()
            steps += 1
            if steps % args.save_every == 0:
                accelerator.save_state(args.state_dir)
        accelerator.print(f"epoch {stream.epoch} done")
    ts.close(finished=True)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
