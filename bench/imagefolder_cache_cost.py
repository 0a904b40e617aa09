"""What an entry of the decode-once cache costs, in one process (``bench/imagefolder.py
--cache-cost``; issue 41).

The images/s of a cold epoch against an uncached one (``--cache``) swing with the load of
a shared 2-core machine more than the cache's cost; CPU time per image, measured in the
one thread that does the work (``time.thread_time``: what other processes do does not
count), does not. For ``--cache-images`` of the JPEGs ``--cache`` makes (500 x 375;
decode and ``Resize(256)`` cached, ``RandomResizedCrop(224)`` + flip after it), in
``--cost-rounds`` rounds, each over images of its own, alternated:

* ``uncached``: the pipeline without the cache (one transform);
* ``cold``: ``producer.torch.cached`` over an empty directory (every image built and
  written), read a batch at a time as producers read it (``__getitems__``: a batch's
  entries written together); ``warm``: the same images again (every image read);

then the parts of a cold entry, each timed alone on the cold round's items: the build
(decode + resize), the augment, the frame's encoding (its crc32 over 262 KB included),
the store's write of one entry alone (its bytes reserved at the end of the process's
segment, written, its index record appended: two rounds of the lock; a batch's entries
share those rounds), and a read (the entry read
from its segment, decoded and its crc checked). Printed: CPU ms per image per
round and the medians, cold / uncached, and the parts' medians in microseconds.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from examples.imagefolder import make_folder, resized_imagefolder

WAYS = ("uncached", "cold", "warm")


def cost_bench(args: argparse.Namespace, root: str) -> dict[str, Any]:
    """The ways' CPU ms per image per round, and the cold entry's parts (us)."""
    from producer.cache_entry import encode_entry
    from producer.torch.cache import _TENSORS  # the tensors' leaf codec

    torch.set_num_threads(1)  # as a producer and a DataLoader worker run it
    make_folder(root, args.cache_images, 500, 375)
    plain = resized_imagefolder(root, args.cache_images, 500, 375, 256, 224)
    n = args.cache_images // args.cost_rounds
    tt = time.thread_time
    per_image: dict[str, list[float]] = {w: [] for w in WAYS}
    parts: dict[str, list[float]] = {p: [] for p in ("build", "augment", "encode", "write", "read")}
    for r in range(args.cost_rounds):
        images = range(r * n, (r + 1) * n)
        directory = tempfile.mkdtemp(prefix="batchq-bench-cost-", dir=args.cache_dir)
        try:
            t0 = tt()
            for i in images:
                plain[i]
            per_image["uncached"].append(1e3 * (tt() - t0) / n)
            ds = resized_imagefolder(root, args.cache_images, 500, 375, 256, 224, directory)
            for way in ("cold", "warm"):
                t0 = tt()
                for b in range(0, n, args.batch_size):  # as a producer reads: a batch at once
                    ds.__getitems__(list(images[b : b + args.batch_size]))
                per_image[way].append(1e3 * (tt() - t0) / n)
            # The parts, on a store of their own (the entries above stay as they are).
            store = type(ds.cache)(f"{directory}/parts")
            for i in images:
                t0 = tt()
                item = ds.dataset[i]
                t1 = tt()
                ds.augment(item)
                t2 = tt()
                payload = encode_entry(item, ds.fingerprint, i, _TENSORS)
                t3 = tt()
                store.write(ds.fingerprint, i, payload)
                t4 = tt()
                ds.stage.get(i, lambda: None)  # a hit: the read of the cold round's entry
                t5 = tt()
                for part, took in zip(
                    parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True
                ):
                    parts[part].append(1e6 * took)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        cells = "  ".join(f"{w} {per_image[w][-1]:.3f}" for w in WAYS)
        print(f"round {r}: CPU ms/image {cells}", flush=True)
    return {"per_image_ms": per_image, "parts_us": parts}


def print_cost(result: dict[str, Any]) -> None:
    per_image, parts = result["per_image_ms"], result["parts_us"]
    med = {w: statistics.median(v) for w, v in per_image.items()}
    print("\nCPU ms per image, median over rounds (spread):")
    for w, v in per_image.items():
        print(f"  {w:9s} {med[w]:.3f} ({min(v):.3f}-{max(v):.3f})")
    ratios = [c / u for c, u in zip(per_image["cold"], per_image["uncached"], strict=True)]
    gains = [u / w for u, w in zip(per_image["uncached"], per_image["warm"], strict=True)]
    print(
        f"  cold / uncached: {statistics.median(ratios):.3f}x "
        f"({min(ratios):.3f}-{max(ratios):.3f}); uncached / warm: {statistics.median(gains):.2f}x"
    )
    print("a cold entry's parts, us (median):")
    print("  " + "  ".join(f"{p} {statistics.median(v):.0f}" for p, v in parts.items()))


def main_cost(args: argparse.Namespace, root: str) -> dict[str, Any]:
    print(
        f"--cache-cost: torch {torch.__version__}, {args.cache_images} JPEGs of 500 x 375 in "
        f"{args.cost_rounds} rounds, cache under {args.cache_dir or tempfile.gettempdir()}",
        flush=True,
    )
    result = cost_bench(args, root)
    print_cost(result)
    return result
