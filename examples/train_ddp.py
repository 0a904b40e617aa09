"""Data-parallel training (DDP) from one batchq queue: every rank its own equal share.

Producers, as many as you like on any hosts (one pool serves every rank)::

    batchq serve examples.train_torch:make_stream --queue digits --workers 4

The trainer, N ranks on this host (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR...)::

    torchrun --nproc-per-node 2 -m examples.train_ddp --queue digits --epochs 5 \\
        --checkpoint ckpt

Each rank reads ``ServerDataStream(..., rank=RANK, world_size=WORLD_SIZE)``: disjoint
shares of every epoch, the same number of batches on every rank (so the all-reduce
never waits for a rank that ran out), in plan order. Every ``--save-every`` steps
each rank saves ``ckpt.rank<r>.pt`` (model, optimiser and its stream's position; the
ranks write, wait for each other, then rename, so the files are of one step). Run it
again with the same ``--checkpoint`` and it resumes exactly there, also with another
``--nproc-per-node``: given every old rank's state, the new ranks re-split the rest of
the epoch among themselves.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from consumer import ServerDataStream
from consumer.torch import TorchStream
from examples.train_torch import Net

__all__ = ["main", "parameters_digest"]


def parameters_digest(model: nn.Module) -> str:
    """A hash of the model's parameters, bit for bit (equal on every rank under DDP)."""
    digest = hashlib.sha1()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _files(prefix: str) -> list[str]:
    return sorted(glob.glob(f"{prefix}.rank*.pt"))


def _save(prefix: str, rank: int, model: nn.Module, opt: Any, ts: TorchStream) -> None:
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "data": ts.state_dict()}
    path = f"{prefix}.rank{rank}.pt"
    torch.save(state, path + ".tmp")
    dist.barrier()  # every rank wrote the same step's state before any file changes
    os.replace(path + ".tmp", path)


def _resume(
    prefix: str, rank: int, world: int, model: nn.Module, opt: Any, ts: TorchStream
) -> None:
    files = _files(prefix)
    if not files:
        return
    saved = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    mine = next((s for s in saved if s["data"].get("rank") == rank), saved[0])
    model.load_state_dict(mine["model"])  # the same on every rank
    opt.load_state_dict(mine["opt"])
    # Every old rank's position: the same world resumes each rank where it was, another
    # world re-splits the rest of the epoch.
    ts.load_state_dict([s["data"] for s in saved])
    if len(files) != world and rank == 0:
        for f in files:  # a new world: the old ranks' files are replaced by ours
            os.remove(f)
    print(f"rank {rank}: resumed at step {mine['data'].get('step', 0)}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Train ``--epochs`` epochs as one rank of a torchrun job; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="Redis URL (default: BATCHQ_URL, localhost)")
    p.add_argument("--queue", default="digits")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--checkpoint", default=None, help="file prefix to save to / resume from")
    p.add_argument("--save-every", type=int, default=20, help="steps between checkpoints")
    p.add_argument("--stop-after", type=int, default=None, help="exit 3 after this many steps")
    p.add_argument("--out", default=None, help="write this rank's summary (JSON) here")
    p.add_argument("--finish", action="store_true", help="end the run: producers exit 0")
    args = p.parse_args(argv)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)  # the same initial model on every rank
    stream = ServerDataStream(
        ("images", "labels"), url=args.url, queue=args.queue, rank=rank, world_size=world
    )
    ts = TorchStream(stream, device=device, dtypes={"images": torch.float32})
    model = DistributedDataParallel(Net().to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if args.checkpoint:
        _resume(args.checkpoint, rank, world, model.module, opt, ts)
    loss_fn = nn.CrossEntropyLoss()
    steps = 0
    per_epoch = []
    try:
        while stream.epoch + 1 < args.epochs:
            n = 0
            for images, labels in ts:
                opt.zero_grad()
                loss_fn(model(images), labels).backward()  # the all-reduce
                opt.step()
                steps, n = steps + 1, n + 1
                if args.checkpoint and steps % args.save_every == 0:
                    _save(args.checkpoint, rank, model.module, opt, ts)
                if args.stop_after is not None and steps >= args.stop_after:
                    ts.close()
                    return 3  # as if killed: the last checkpoint is what counts
            per_epoch.append(n)
            print(f"rank {rank}: epoch {stream.epoch}: {n} steps", flush=True)
        summary = {"rank": rank, "per_epoch": per_epoch, "params": parameters_digest(model)}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(summary, f)
        ts.close(finished=args.finish)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
