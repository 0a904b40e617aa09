"""An Accelerate training job (CPU ranks, gloo) fed by a TorchStream, with checkpoints.

Run as ``accelerate_job.py URL QUEUE OUT_DIR EPOCHS [--stop-at N] [--resume]`` with
torchrun's variables set. The stream is registered for checkpointing
(``register_for_checkpointing``) and passed to ``prepare()`` as it is; every 3 steps
``save_state(OUT_DIR/state)`` keeps the model, the optimiser and the stream's state
(Accelerate writes rank 0's copy only). Each rank appends [epoch, example indices] per
step to ``OUT_DIR/rank<r>.jsonl``. ``--stop-at N`` ends the process after step N as a
kill would (``os._exit``); ``--resume`` first loads the saved state.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate import Accelerator
from pipelines import examples_of
from torchrun import job_parser

from consumer import ServerDataStream
from consumer.torch import TorchStream


def main() -> int:
    args = job_parser().parse_args()
    accelerator = Accelerator(cpu=True)
    stream = ServerDataStream(("features", "targets"), url=args.url, queue=args.queue)
    ts = TorchStream(stream)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, ts = accelerator.prepare(model, opt, ts)
    accelerator.register_for_checkpointing(ts)
    saved = os.path.join(args.out_dir, "state")
    if args.resume:
        accelerator.load_state(saved)
    out = os.path.join(args.out_dir, f"rank{accelerator.process_index}.jsonl")
    steps = 0
    while stream.epoch + 1 < args.epochs:
        for features, _ in ts:
            loss = model(features.float() / 1000).mean()
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            with open(out, "a") as f:
                f.write(json.dumps([stream.epoch, examples_of(features.numpy())]) + "\n")
            steps += 1
            if steps % 3 == 0:
                accelerator.save_state(saved)
            if args.stop_at is not None and steps >= args.stop_at:
                os._exit(3)
    ts.close(finished=True)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
