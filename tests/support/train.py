"""A trainer process for the resume tests.

Reads epochs from a queue and writes one JSON line per batch yielded (epoch, the
example indices) to --out, flushed; with --state-out, after each batch (or, with
--state-at N, after the N-th batch only: an older checkpoint) it also saves state_dict()
there (atomically). With --state-in it first resumes from that file (a state,
or a list of every rank's states). The tests build its command line with :func:`argv` and
read what it wrote with :func:`lines`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from pipelines import examples_of

from consumer import ServerDataStream


def argv(url: str, queue: str, out: Path, epochs: int, *extra: str) -> list[str]:
    """The command line of this script (a trainer reading ``epochs`` epochs)."""
    script = str(Path(__file__).resolve())
    return [sys.executable, script, "--url", url, "--queue", queue, "--epochs", str(epochs),
            "--out", str(out), *extra]  # fmt: skip


def lines(path: Path) -> list[tuple[int, list[int]]]:
    """What a trainer wrote to --out: (epoch, example indices) per batch."""
    if not path.exists():
        return []
    return [tuple(json.loads(line)) for line in path.read_text().splitlines()]  # type: ignore[misc]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--epochs", type=int, required=True, help="stop before this epoch")
    parser.add_argument("--out", required=True)
    parser.add_argument("--state-in")
    parser.add_argument("--state-out")
    parser.add_argument("--state-at", type=int, help="save the state after this batch only")
    parser.add_argument("--unordered", action="store_true")
    parser.add_argument("--finish", action="store_true", help="close(finished=True) at the end")
    parser.add_argument("--rank", type=int, help="default: found (RANK, torch.distributed)")
    parser.add_argument("--world", type=int, help="default: found (WORLD_SIZE, ...)")
    parser.add_argument("--even", default="pad")
    parser.add_argument("--stop-after", type=int, help="exit 3 after this many batches")
    parser.add_argument("--until", help="read epochs (past --epochs) until this file exists")
    parser.add_argument("--figures", help="write the stream's figures here at the end (JSON)")
    parser.add_argument("--group", help="read as this group (a run read by several groups)")
    parser.add_argument("--max-lag", type=int, help="the group's max_lag_batches")
    parser.add_argument("--stats-out", help="write the stream's figures there at the end")
    parser.add_argument("--claim-ttl-s", type=float, default=2.0)
    args = parser.parse_args()
    stream = ServerDataStream(
        ("features", "targets"),
        url=args.url,
        queue=args.queue,
        ordered=not args.unordered,
        timeout_s=60,
        stall_s=1.0,
        claim_ttl_s=args.claim_ttl_s,
        rank=args.rank,
        world_size=args.world,
        even_batches=args.even,
        group=args.group,
        max_lag_batches=args.max_lag,
    )
    if args.state_in:
        with open(args.state_in) as f:
            stream.load_state_dict(json.load(f))
    yielded = 0
    waits: list[float] = []  # seconds between consecutive batches
    last = None
    with open(args.out, "a") as out:
        while stream.epoch + 1 < args.epochs or (args.until and not os.path.exists(args.until)):
            it = stream.get_epoch_iterator()
            for features, _ in it:
                now = time.monotonic()
                if last is not None:
                    waits.append(now - last)
                last = now
                out.write(json.dumps([stream.epoch, examples_of(features)]) + "\n")
                out.flush()
                yielded += 1
                if args.state_out and args.state_at in (None, yielded):
                    tmp = args.state_out + ".tmp"
                    with open(tmp, "w") as f:
                        json.dump(stream.state_dict(), f)
                    os.replace(tmp, args.state_out)
                if args.stop_after is not None and yielded >= args.stop_after:
                    stream.close()
                    return 3
    if args.figures:
        write_figures(stream, args.figures, waits)
    stream.close(finished=args.finish)
    if args.stats_out:
        with open(args.stats_out, "w") as f:
            json.dump({"shm_frames": stream._shm.frames, **stream.stats}, f)
    return 0


def write_figures(stream: ServerDataStream, path: str, waits: list[float]) -> None:
    """What the trainer dropped and redid: duplicates (frames it had already: a shard
    built again, a frame a failover brought back), frames past its window, bad frames;
    and its ten longest waits for a batch (s)."""
    buffer, reader = stream._buffer, stream._reader
    figures = {
        "epochs": stream.epoch + 1,
        "duplicates": buffer.ledger.duplicates if buffer is not None else 0,
        "dropped_ahead": stream.stats["dropped_ahead"],
        "bad_frames": reader.bad_frames if reader is not None else 0,
        "longest_waits_s": [round(w, 2) for w in sorted(waits, reverse=True)[:10]],
    }
    with open(path, "w") as f:
        json.dump(figures, f)


if __name__ == "__main__":
    sys.exit(main())
