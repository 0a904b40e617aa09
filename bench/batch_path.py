"""The path of one batch through the library, traced (issue 38's files and returns).

A producer (a thread of this process, serving a Fuel DataStream) and a trainer
(``ServerDataStream``) share a private redis-server; hwm 1 keeps them in step, so each
trainer step moves one batch through every stage: the producer's build and push, the
reader thread's pop, fetch and filing, the iterator's hand-over. After a warm-up epoch,
each of ``--steps`` steps (one ``next()`` of the trainer, and what every thread of the
process ran meanwhile) is traced with ``sys.setprofile``: per thread, the library file
whose code runs changes at a *step* (into a callee's file or back to a caller's); a
*return* is a step into a file this thread already left in that window. The median step
is printed: library files entered, steps, returns. Twice: frames inline in Redis
(``transport='redis'``) and through shared memory (``'auto'``, the producer on this
host).

Only files under batchq/, producer/ and consumer/ count; code of numpy, redis-py or the
standard library is seen through the library frame that called it.

    python bench/batch_path.py              # --steps 15 --json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import threading
import uuid
from pathlib import Path
from types import FrameType
from typing import Any

import numpy

from batchq.host.embedded import url_or_embedded
from consumer import ServerDataStream
from producer import start_server
from producer.datasets import IndexableDataset
from producer.schemes import SequentialScheme
from producer.streams import DataStream

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = tuple(f"{ROOT / part}/" for part in ("batchq", "producer", "consumer"))
EXAMPLES = 512
BATCH = 8


class Tracer:
    """The library files each thread runs, as a sequence of file changes, while on.

    The profile function is installed before any thread of the run starts (Python 3.11
    has no way to install it in running threads) and records only while ``on``.
    """

    def __init__(self) -> None:
        self.sequences: dict[int, list[str]] = {}
        self.on = False

    def _file(self, frame: FrameType | None) -> str | None:
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(LIBRARY):
                return str(Path(name).relative_to(ROOT))
            frame = frame.f_back
        return None

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on:
            return
        if event == "call":
            where = self._file(frame)
        elif event == "return":
            where = self._file(frame.f_back)
        else:
            return
        if where is None:
            return
        sequence = self.sequences.setdefault(threading.get_ident(), [])
        if not sequence or sequence[-1] != where:
            sequence.append(where)

    def figures(self) -> dict[str, int]:
        files: set[str] = set()
        steps = returns = 0
        for sequence in self.sequences.values():
            files.update(sequence)
            left: set[str] = set()
            for before, after in itertools.pairwise(sequence):
                steps += 1
                left.add(before)
                returns += after in left
        return {"files": len(files), "steps": steps, "returns": returns}


def trace_steps(url: str, transport: str, steps: int) -> list[dict[str, Any]]:
    """Each traced step's figures (and its files) for one transport."""
    queue = f"batch-path-{uuid.uuid4().hex[:8]}"
    features = numpy.arange(EXAMPLES * 64, dtype=numpy.float32).reshape(EXAMPLES, 64)
    dataset = IndexableDataset({"features": features})
    producer_stream = DataStream(dataset, iteration_scheme=SequentialScheme(EXAMPLES, BATCH))
    tracer = Tracer()
    threading.setprofile(tracer.profile)
    sys.setprofile(tracer.profile)
    served = threading.Thread(
        target=start_server,
        args=(producer_stream,),
        kwargs={"hwm": 1, "url": url, "queue": queue, "handle_signals": False},
        daemon=True,
    )
    served.start()
    stream = ServerDataStream(
        ("features",), url=url, queue=queue, hwm=1, transport=transport, timeout_s=30.0
    )
    found: list[dict[str, Any]] = []
    try:
        for _ in stream.get_epoch_iterator():  # the warm-up epoch: claims, joins, plans
            pass
        epochs = stream.get_epoch_iterator()
        for _ in range(4):  # the epoch's start
            next(epochs)
        for _ in range(min(steps, EXAMPLES // BATCH - 4)):
            tracer.sequences = {}
            tracer.on = True
            try:
                next(epochs)
            finally:
                tracer.on = False
            figures = tracer.figures()
            figures["paths"] = sorted({f for s in tracer.sequences.values() for f in s})
            found.append(figures)
    finally:
        stream.close(finished=True)
        served.join(timeout=30.0)
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a Redis URL (default: a private embedded server)")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="print every step as JSON")
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {}
    with url_or_embedded(args.url) as url:
        for transport in ("redis", "auto"):
            print(f"tracing {args.steps} steps, transport={transport} ...", file=sys.stderr)
            results[transport] = trace_steps(url, transport, args.steps)
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"{'transport':<10} {'files':>6} {'steps':>6} {'returns':>8}   (median step)")
    for transport, found in results.items():
        median = {k: statistics.median(f[k] for f in found) for k in ("files", "steps", "returns")}
        print(
            f"{transport:<10} {median['files']:>6g} {median['steps']:>6g} {median['returns']:>8g}"
        )
        widest = max(found, key=lambda f: f["files"])
        print(f"  files of the widest step ({widest['files']}): {', '.join(widest['paths'])}")


if __name__ == "__main__":
    main()
