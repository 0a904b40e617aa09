"""One rank of an Accelerate job (CPU processes, gloo) reading a TorchStream.

Run as ``accelerate_rank.py URL QUEUE OUT`` with torchrun's variables set (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT): ``accelerator.prepare(DataLoader(ts))`` must be
refused at its first batch (Accelerate's DataLoaderDispatcher would read on rank 0
only), and so must ``dispatch_batches=False``'s IterableDatasetShard (it would keep
every other batch of the rank's share); then another stream in a plain
``DataLoader(ts, batch_size=None)`` reads this rank's share of one epoch. Writes {rank,
world, refused, shard_refused, batches} as JSON to OUT.
"""

from __future__ import annotations

import json
import sys

import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from pipelines import examples_of

from consumer import ServerDataStream
from consumer.torch import DataLoaderDispatchError, TorchStream


def main() -> int:
    url, queue, out = sys.argv[1:4]
    accelerator = Accelerator(cpu=True)  # initialises the gloo process group
    refused = ""
    wrapped = TorchStream(ServerDataStream(("features", "targets"), url=url, queue=queue))
    prepared = accelerator.prepare(torch.utils.data.DataLoader(wrapped, batch_size=None))
    try:
        next(iter(prepared))  # the first step's batch
    except DataLoaderDispatchError as e:
        refused = str(e)
    shard_refused = ""
    sharded = prepare_data_loader(
        torch.utils.data.DataLoader(wrapped, batch_size=None),
        num_processes=accelerator.num_processes,
        process_index=accelerator.process_index,
        put_on_device=False,
        dispatch_batches=False,
    )
    try:
        next(iter(sharded))
    except DataLoaderDispatchError as e:
        shard_refused = str(e)
    stream = ServerDataStream(("features", "targets"), url=url, queue=queue, timeout_s=60)
    ts = TorchStream(stream)
    loader = torch.utils.data.DataLoader(ts, batch_size=None)
    batches = [examples_of(features.numpy()) for features, _ in loader]
    ts.close(finished=True)
    with open(out, "w") as f:
        summary = {"rank": stream.rank, "world": stream.world_size, "refused": refused}
        summary["shard_refused"] = shard_refused
        json.dump(summary | {"batches": batches}, f)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
