"""A real image pipeline: torch's DataLoader against batchq, in one run, on this host.

The pipeline is examples/imagefolder.py's: torchvision's ImageFolder over 256 x 256
JPEGs (made on first use), ``v2.RandomResizedCrop(224)``, ``v2.RandomHorizontalFlip()``,
``v2.ToImage()``, ``v2.ToDtype(torch.uint8)``, batches of 32; the trainer's loop only
normalises each batch to float32 (its share of the pipeline), then waits ``--step-ms``
(an accelerator's step, during which the host's CPU is free: 0, input-bound, and 60 ms,
about the pipeline's own time per batch here). Three ways, alternated within each
repeat:

* ``loader``: ``DataLoader(dataset, batch_size, shuffle=True, num_workers=N,
  persistent_workers=True)`` in the trainer's process (the baseline);
* ``batchq-shm``: N ``batchq serve examples.imagefolder:make_loader`` producers on this
  host (the same DataLoader, its dataset served; shared memory, the default) into a
  ``TorchStream``;
* ``batchq-redis``: the same with ``--transport redis``: every byte through Redis, the
  path of producers on other hosts.

Each runs ``--epochs`` epochs, started from nothing (the DataLoader and the producer
processes are made at the clock's zero). Printed per way: images/s from the first batch
of epoch 1 to the end (every later epoch's start included), the time to the first batch
of each epoch (epoch 1: from the clock's zero, so the workers' or producers' start is
in it), and the trainer process's CPU per batch over the same span (the DataLoader's
workers and the producers are other processes); then the ratios to the loader of the
same repeat. Figures are printed, never asserted.

    python bench/imagefolder.py [--url URL] [--workers 2] [--images 2000] [--repeats 2] [--json]

``--startup`` measures the first batch of fresh processes instead (issue 40; the code is
bench/imagefolder_startup.py): cold, producers first, a resumed trainer, and a worker
added by the autoscaler, batchq's pool forking its workers against spawning them.
``--cache`` measures decode once (issue 41) served by producers, ``--cache-cost`` the CPU
an entry of that cache costs, in one process (bench/imagefolder_cache_cost.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from batchq.host.embedded import url_or_embedded  # noqa: E402
from batchq.host.procs import spawn, stop_group  # noqa: E402
from consumer import ServerDataStream  # noqa: E402
from consumer.torch import TorchStream  # noqa: E402
from examples.imagefolder import DEFAULT_ROOT, imagefolder, make_folder, normalise  # noqa: E402

KINDS = ("loader", "batchq-shm", "batchq-redis")


def _epochs(source: Any, epochs: int, zero: float, step_s: float) -> dict[str, Any]:
    """Iterate ``epochs`` epochs of ``source`` (iter() per epoch), normalising batches
    and then waiting ``step_s`` (an accelerator's step: the host's CPU is free)."""
    first_s: list[float] = []
    images = batches = 0
    t1 = cpu1 = 0.0
    for e in range(epochs):
        asked = time.perf_counter()
        it: Iterable[Any] = iter(source)
        for k, (x, _labels) in enumerate(it):
            if k == 0:
                now = time.perf_counter()
                first_s.append(now - (zero if e == 0 else asked))
                if e == 0:  # the span of images/s and CPU starts at the first batch
                    t1, cpu1 = now, time.process_time()
            normalise(x)
            if step_s:
                time.sleep(step_s)
            images += len(x)
            batches += 1
    took = time.perf_counter() - t1
    first_images = images // max(batches, 1)  # one batch is before the span
    return {
        "images_per_s": (images - first_images) / took,
        "first_batch_s": first_s,
        "cpu_ms_per_batch": 1000 * (time.process_time() - cpu1) / max(batches - 1, 1),
        "batches": batches,
    }


def run_loader(args: argparse.Namespace) -> dict[str, Any]:
    zero = time.perf_counter()
    loader = DataLoader(
        imagefolder(args.root, args.images),
        batch_size=args.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
        num_workers=args.workers,
        persistent_workers=True,
    )
    try:
        return _epochs(loader, args.epochs, zero, args.step_s)
    finally:
        del loader  # its persistent workers stop with their iterator


def run_batchq(url: str, transport: str, args: argparse.Namespace) -> dict[str, Any]:
    queue = f"bench-img-{uuid.uuid4().hex[:8]}"
    argv = [sys.executable, "-m", "batchq.cli", "--log-level", "WARNING", "serve"]
    argv += ["examples.imagefolder:make_loader", "--url", url, "--queue", queue]
    argv += ["--hwm", str(args.hwm), "--transport", transport]
    argv += ["--arg", f"root={args.root}", "--arg", f"images={args.images}"]
    argv += ["--arg", f"batch_size={args.batch_size}"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
    }
    zero = time.perf_counter()
    procs = [spawn(argv, env=env) for _ in range(args.workers)]
    stream = ServerDataStream(
        None, False, url=url, queue=queue, hwm=args.hwm, timeout_s=120, transport=transport
    )
    try:
        with TorchStream(stream) as ts:
            result = _epochs(ts, args.epochs, zero, args.step_s)
            ts.close(finished=True)
        return result
    finally:
        for proc in procs:
            stop_group(proc, timeout_s=10.0)


def bench(url: str, args: argparse.Namespace) -> dict[str, Any]:
    rounds: list[dict[str, Any]] = []
    print(f"trainer step {args.step_s * 1000:.0f} ms a batch after normalising", flush=True)
    for r in range(args.repeats):
        row: dict[str, Any] = {}
        for kind in KINDS:
            if kind == "loader":
                row[kind] = run_loader(args)
            else:
                row[kind] = run_batchq(url, kind.removeprefix("batchq-"), args)
            res = row[kind]
            firsts = ", ".join(f"{s:.3f}" for s in res["first_batch_s"])
            print(
                f"repeat {r} {kind:13s} {res['images_per_s']:7.1f} images/s, first batch "
                f"[{firsts}] s, trainer CPU {res['cpu_ms_per_batch']:.2f} ms/batch",
                flush=True,
            )
        rounds.append(row)
    return {"rounds": rounds}


def print_table(results: dict[str, Any]) -> None:
    rounds = results["rounds"]

    def med(kind: str, key: str, i: int | None = None) -> float:
        vals = [r[kind][key] if i is None else r[kind][key][i] for r in rounds]
        return statistics.median(vals)

    def ratio(kind: str, key: str, i: int | None = None) -> float:
        vals = [
            (r[kind][key] if i is None else r[kind][key][i])
            / (r["loader"][key] if i is None else r["loader"][key][i])
            for r in rounds
        ]
        return statistics.median(vals)

    epochs = len(rounds[0]["loader"]["first_batch_s"])
    print()
    head = "way            images/s  " + "  ".join(f"first@{e + 1}" for e in range(epochs))
    print(head + "  CPU ms/batch")
    for kind in KINDS:
        firsts = "  ".join(f"{med(kind, 'first_batch_s', e):7.3f}" for e in range(epochs))
        cpu = med(kind, "cpu_ms_per_batch")
        print(f"{kind:13s} {med(kind, 'images_per_s'):9.1f}  {firsts}  {cpu:8.2f}")
    print("\nratios to the loader of the same repeat (median over repeats):")
    for kind in KINDS[1:]:
        firsts = "  ".join(f"{ratio(kind, 'first_batch_s', e):.2f}x" for e in range(epochs))
        print(
            f"{kind:13s} images/s {ratio(kind, 'images_per_s'):.2f}x, first batch {firsts}, "
            f"trainer CPU {ratio(kind, 'cpu_ms_per_batch'):.2f}x"
        )


# --------------------------------------------------------------------------- --cache
# Decode once (producer.torch.cached): a block of its own (``--cache``), kept apart from
# the comparison above. JPEGs of ImageNet's typical size (500 x 375), made here; the
# pipeline is examples.imagefolder.resized_imagefolder's: decode and resize to 256 (the
# cached stage), RandomResizedCrop(224) and a flip (augment). Three ways, each from
# nothing, in the same run: a DataLoader(num_workers=W, persistent_workers=True) over
# the uncached pipeline, W batchq producers over it, and W producers over the cached
# one (a cache directory made empty first: epoch 1 is cold). Printed: images/s of each
# epoch (epoch 1 from its first batch, later epochs from the trainer's iter()), and the
# ratios the issue asks for.

CACHE_KINDS = ("loader", "batchq", "batchq-cached")


def _cache_epochs(source: Any, epochs: int) -> list[float]:
    """images/s of each epoch of ``source`` (input-bound: the loop only normalises)."""
    rates = []
    for e in range(epochs):
        started = time.perf_counter()
        images = 0
        for k, (x, _labels) in enumerate(iter(source)):
            if e == 0 and k == 0:  # epoch 1 from its first batch: start-up is not in it
                started = time.perf_counter()
                continue
            normalise(x)
            images += len(x)
        rates.append(images / (time.perf_counter() - started))
    return rates


def _cache_loader(args: argparse.Namespace, root: str) -> list[float]:
    from examples.imagefolder import resized_imagefolder

    dataset = resized_imagefolder(root, args.cache_images, 500, 375, 256, 224)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
        num_workers=args.workers,
        persistent_workers=True,
    )
    try:
        return _cache_epochs(loader, args.epochs)
    finally:
        del loader


def _cache_batchq(
    url: str, args: argparse.Namespace, root: str, cache_dir: str | None
) -> list[float]:
    queue = f"bench-cache-{uuid.uuid4().hex[:8]}"
    argv = [sys.executable, "-m", "batchq.cli", "--log-level", "WARNING", "serve"]
    argv += ["examples.imagefolder:make_loader", "--url", url, "--queue", queue]
    argv += ["--hwm", str(args.hwm), "--arg", f"root={root}"]
    argv += ["--arg", f"images={args.cache_images}", "--arg", f"batch_size={args.batch_size}"]
    argv += ["--arg", "side=500", "--arg", "height=375", "--arg", "resize=256"]
    if cache_dir is not None:
        argv += ["--arg", f"cache_dir={cache_dir}"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
    }
    procs = [spawn(argv, env=env) for _ in range(args.workers)]
    stream = ServerDataStream(None, False, url=url, queue=queue, hwm=args.hwm, timeout_s=300)
    try:
        with TorchStream(stream) as ts:
            rates = _cache_epochs(ts, args.epochs)
            cache = stream.stats.get("cache")
            if cache:
                print(
                    f"  cache: {cache['hits']} hits, {cache['misses']} misses, "
                    f"{cache['bytes'] / 1e6:.0f} MB held, "
                    f"build time saved {cache['saved_s']:.1f} s",
                    flush=True,
                )
            ts.close(finished=True)
        return rates
    finally:
        for proc in procs:
            stop_group(proc, timeout_s=10.0)


def bench_cache(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The three ways, ``--repeats`` times, alternated; printed as they finish."""
    import shutil
    import tempfile

    from examples.imagefolder import make_folder

    root = f"{args.root}-500x375"
    make_folder(root, args.cache_images, 500, 375)  # before any clock starts
    rounds: list[dict[str, list[float]]] = []
    for r in range(args.repeats):
        row: dict[str, list[float]] = {}
        for kind in args.cache_kinds:
            cache_dir = tempfile.mkdtemp(prefix="batchq-bench-cache-", dir=args.cache_dir)
            try:
                if kind == "loader":
                    row[kind] = _cache_loader(args, root)
                else:
                    row[kind] = _cache_batchq(
                        url, args, root, cache_dir if kind == "batchq-cached" else None
                    )
            finally:
                shutil.rmtree(cache_dir, ignore_errors=True)
            rates = ", ".join(f"{v:.1f}" for v in row[kind])
            print(f"repeat {r} {kind:14s} images/s by epoch [{rates}]", flush=True)
        rounds.append(row)
    return {"rounds": rounds}


def print_cache_table(results: dict[str, Any]) -> None:
    rounds = results["rounds"]

    def med(kind: str, e: int) -> float:
        return statistics.median(r[kind][e] for r in rounds)

    epochs = len(rounds[0]["loader"])
    print("\nway             " + "  ".join(f"epoch {e + 1:d}" for e in range(epochs)))
    for kind in CACHE_KINDS:
        print(f"{kind:14s} " + "  ".join(f"{med(kind, e):7.1f}" for e in range(epochs)))
    later = range(1, epochs)

    def ratio(num: str, e_num: int, den: str, e_den: int) -> float:
        return statistics.median(r[num][e_num] / r[den][e_den] for r in rounds)

    print("\nratios (median over repeats, each within its repeat):")
    for e in later:
        own = ratio("batchq-cached", e, "batchq-cached", 0)
        print(f"  cached epoch {e + 1} / cached epoch 1:          {own:.2f}x")
        loader = ratio("batchq-cached", e, "loader", e)
        print(f"  cached epoch {e + 1} / DataLoader epoch {e + 1}:      {loader:.2f}x")
    print(
        f"  cached epoch 1 / uncached batchq epoch 1: {ratio('batchq-cached', 0, 'batchq', 0):.2f}x"
    )
    for e in range(epochs):
        print(
            f"  uncached batchq / DataLoader, epoch {e + 1}: {ratio('batchq', e, 'loader', e):.2f}x"
        )


def main_cache(args: argparse.Namespace) -> int:
    load0 = os.getloadavg()[0]
    print(
        f"--cache: torch {torch.__version__}, {os.cpu_count()} CPUs, {args.workers} workers, "
        f"{args.cache_images} JPEGs of 500 x 375, batch {args.batch_size}, load {load0:.2f}",
        flush=True,
    )
    with url_or_embedded(args.url) as url:
        results = bench_cache(url, args)
    if len(args.cache_kinds) == len(CACHE_KINDS):
        print_cache_table(results)
    print(f"load average before {load0:.2f}, after {os.getloadavg()[0]:.2f}")
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="Redis (default: a private embedded server)")
    p.add_argument("--root", default=DEFAULT_ROOT)
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--hwm", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--step-ms",
        type=float,
        nargs="+",
        default=[0.0, 60.0],
        help="the trainer's step per batch, in turn (0: input-bound; 60: a GPU's step "
        "about as long as the pipeline's batch)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--cache",
        action="store_true",
        help="instead: decode once (producer.torch.cached) against the uncached pipeline",
    )
    p.add_argument("--cache-images", type=int, default=1200, help="--cache: JPEGs to make")
    p.add_argument(
        "--cache-dir", default=None, help="--cache: where the caches go (default: TMPDIR)"
    )
    p.add_argument(
        "--cache-cost",
        action="store_true",
        help="instead: the CPU an entry of the cache costs, in one process, uncached, cold "
        "and warm alternated (bench/imagefolder_cache_cost.py)",
    )
    p.add_argument("--cost-rounds", type=int, default=5, help="--cache-cost: rounds")
    p.add_argument(
        "--cache-kinds",
        nargs="+",
        default=list(CACHE_KINDS),
        choices=CACHE_KINDS,
        help="--cache: the ways to run (the ratios need all three)",
    )
    p.add_argument(
        "--startup",
        action="store_true",
        help="measure the first batch of fresh processes instead (issue 40): cold, "
        "producers first, a resumed trainer, a worker added by --workers 1:2",
    )
    p.add_argument("--startup-rounds", type=int, default=3, help="rounds of --startup")
    p.add_argument(
        "--startup-cold-only",
        action="store_true",
        help="--startup: only the cold case (DataLoader, fork, spawn; a round in seconds)",
    )
    args = p.parse_args(argv)
    if args.cache_cost:
        from imagefolder_cache_cost import main_cost  # this folder's (bench/)

        measured = main_cost(args, f"{args.root}-500x375")
        if args.json:
            print(json.dumps(measured, indent=2))
        return 0
    if args.cache:
        return main_cache(args)
    make_folder(args.root, args.images)  # once, before any clock starts
    if args.startup:
        print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.workers} workers, "
              f"{args.images} images, load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
        from imagefolder_startup import startup_bench  # this folder's (bench/)

        measured = startup_bench(args)
        if args.json:
            print(json.dumps(measured, indent=2))
        return 0
    load0 = os.getloadavg()[0]
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.workers} workers, "
        f"{args.images} images, batch {args.batch_size}, load {load0:.2f}",
        flush=True,
    )
    results: dict[str, Any] = {}
    with url_or_embedded(args.url) as url:
        for step_ms in args.step_ms:
            args.step_s = step_ms / 1000
            results[f"step_ms={step_ms:g}"] = bench(url, args)
    for name, result in results.items():
        print(f"\n== trainer {name} ==")
        print_table(result)
    print(f"load average before {load0:.2f}, after {os.getloadavg()[0]:.2f}")
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
