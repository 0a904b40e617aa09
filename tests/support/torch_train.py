"""A trainer process reading a torch stream's ``("index", "aug")`` batches, for the
tests that kill and resume it.

Writes one JSON line per batch yielded to --out, flushed: the epoch, the batch's example
indices and the sha256 of its bytes (every source). With --state-out it saves
state_dict() there (atomically) after batch --state-at; with --state-in it first resumes
from that file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import numpy as np

from consumer import ServerDataStream


def digest(batch: tuple[object, ...]) -> str:
    """The sha256 of a batch's bytes, source after source."""
    h = hashlib.sha256()
    for value in batch:
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--state-out")
    parser.add_argument("--state-at", type=int)
    parser.add_argument("--state-in")
    args = parser.parse_args()
    stream = ServerDataStream(
        ("index", "aug"), url=args.url, queue=args.queue, timeout_s=60, stall_s=1.0,
        claim_ttl_s=2.0, rank=args.rank, world_size=args.world,
    )  # fmt: skip
    if args.state_in:
        with open(args.state_in) as f:
            stream.load_state_dict(json.load(f))
    yielded = 0
    with open(args.out, "a") as out:
        while stream.epoch + 1 < args.epochs:
            for batch in stream.get_epoch_iterator():
                indices = np.asarray(batch[0]).tolist()
                out.write(json.dumps([stream.epoch, indices, digest(batch)]) + "\n")
                out.flush()
                yielded += 1
                if args.state_out and yielded == args.state_at:
                    tmp = args.state_out + ".tmp"
                    with open(tmp, "w") as f:
                        json.dump(stream.state_dict(), f)
                    os.replace(tmp, args.state_out)
        json.dump({"stats": stream.stats}, out)  # the last line: the stream's figures
        out.write("\n")
    stream.close(finished=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
