"""A real image pipeline: torchvision's ImageFolder over JPEGs, served by batchq.

A training script's DataLoader, moved into a factory as it is (the port's step 1)::

    batchq serve examples.imagefolder:make_loader --workers 2 --queue images \\
        --arg root=/tmp/batchq-imagefolder                         # step 2: serve it

and the trainer iterates a TorchStream instead of the DataLoader (step 3)::

    python -m examples.imagefolder --queue images --root /tmp/batchq-imagefolder

(``--serve 2`` starts the two producers itself.) The folder is made on first use: a few
thousand 256 x 256 JPEGs in class folders, each class its own colour pattern plus noise
(PIL). The producers decode, crop and flip (``v2.RandomResizedCrop(224)``,
``v2.RandomHorizontalFlip()``, ``v2.ToImage()``, ``v2.ToDtype(torch.uint8)``) and send
uint8 batches; the trainer normalises (on its device, where that is cheap) and trains a
small CNN. Each batch's crops and flips are drawn from torch's generator, which the
producer seeds per batch: a batch built again (another producer, a resume) is the same.

**Decode once** (``--cache DIR``, with ``--resize 256``): the pipeline is split at the
cache (:func:`stages`). The deterministic stage, decoding the JPEG and resizing it
(``v2.ToImage()``, ``v2.Resize(256)``), is the dataset's transform and is cached in DIR
(``producer.torch.cached``); the random crop and flip are its ``augment``, run on every
read under the producer's per-batch seeds. From the second epoch on the producers read
decoded images instead of decoding JPEGs, and every batch is the same, byte for byte, as
without the cache (the same transforms in one ``Compose``)::

    batchq serve examples.imagefolder:make_loader --workers 2 --queue images \
        --arg resize=256 --arg cache_dir=/var/cache/batchq-images
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

__all__ = [
    "Net",
    "OnImage",
    "imagefolder",
    "main",
    "make_folder",
    "make_loader",
    "resized_imagefolder",
    "stages",
]

DEFAULT_ROOT = os.path.join(os.environ.get("TMPDIR", "/tmp"), "batchq-imagefolder")
CLASSES = 4
_DONE = ".complete"  # written last: a folder half-made by a killed run is made again


def make_folder(
    root: str | os.PathLike[str], images: int = 2000, side: int = 256, height: int | None = None
) -> Path:
    """A folder of ``images`` JPEGs in ``CLASSES`` class folders, made once (PIL): ``side``
    wide and ``height`` high (default ``side``; ImageNet's typical photo: 500 x 375)."""
    from PIL import Image

    path = Path(root)
    marker = path / _DONE
    high = side if height is None else height
    stamp = f"{images} {side}" if high == side else f"{images} {side}x{high}"
    if marker.exists() and marker.read_text() == stamp:
        return path
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:high, 0:side]
    for c in range(CLASSES):
        (path / f"class{c}").mkdir(parents=True, exist_ok=True)
        # Class c: stripes at its own angle and colour; the crops must find them.
        angle = np.pi * c / CLASSES
        stripes = (np.sin((xx * np.cos(angle) + yy * np.sin(angle)) / 6.0) > 0)[..., None]
        colour = np.array([80 + 40 * c, 200 - 40 * c, 120], np.uint8)
        for i in range(c, images, CLASSES):
            noise = rng.integers(0, 60, (high, side, 3), dtype=np.uint8)
            pixels = np.where(stripes, colour, 30).astype(np.uint8) + noise
            Image.fromarray(pixels).save(path / f"class{c}" / f"{i:05d}.jpg", quality=90)
    marker.write_text(stamp)
    return path


def imagefolder(root: str, images: int = 2000, side: int = 256, crop: int = 224) -> Any:
    """torchvision's ImageFolder over :func:`make_folder`, with the random v2 transforms."""
    from producer.torch import import_torchvision

    tv = import_torchvision()
    from torchvision.transforms import v2  # after import_torchvision (see producer.torch)

    transform = v2.Compose(
        [
            v2.RandomResizedCrop(crop),
            v2.RandomHorizontalFlip(),
            v2.ToImage(),
            v2.ToDtype(torch.uint8),  # normalisation belongs to the trainer
        ]
    )
    return tv.datasets.ImageFolder(str(make_folder(root, images, side)), transform=transform)


def stages(resize: int, crop: int) -> tuple[Any, Any]:
    """The pipeline split at the cache: (the deterministic stage, the random augment).

    ``Compose([*stage.transforms, *augment.transforms])`` is the uncached pipeline; the
    augment takes the stage's ``(image, label)`` item (v2 transforms pass the label
    through untouched).
    """
    from producer.torch import import_torchvision

    import_torchvision()
    from torchvision.transforms import v2

    stage = v2.Compose([v2.ToImage(), v2.Resize(resize)])  # decode (PIL), resize: cached
    augment = v2.Compose(
        [v2.RandomResizedCrop(crop), v2.RandomHorizontalFlip(), v2.ToDtype(torch.uint8)]
    )
    return stage, augment


def resized_imagefolder(
    root: str,
    images: int = 2000,
    side: int = 500,
    height: int | None = 375,
    resize: int = 256,
    crop: int = 224,
    cache_dir: str | None = None,
    cache_bytes: int | None = None,
) -> Any:
    """ImageFolder over :func:`make_folder` (``side`` x ``height`` JPEGs), decoded, resized
    to ``resize``, cropped at random and flipped: with ``cache_dir``, the decoded and
    resized images are cached there (:func:`stages`), else all in one transform."""
    from producer.torch import DiskCache, cached, import_torchvision

    tv = import_torchvision()
    from torchvision.transforms import v2

    folder = str(make_folder(root, images, side, height))
    stage, augment = stages(resize, crop)
    if cache_dir is None:
        whole = v2.Compose([*stage.transforms, *augment.transforms])
        return tv.datasets.ImageFolder(folder, transform=whole)
    decoded = tv.datasets.ImageFolder(folder, transform=stage)
    return cached(
        decoded, augment=OnImage(augment), cache=DiskCache(cache_dir, max_bytes=cache_bytes)
    )


class OnImage:
    """``transform`` applied to an ``(image, label)`` item's image alone, as ImageFolder
    applies the uncached pipeline's: the same draws and bytes as ``transform(item)``
    (v2 draws once per call), without v2's walk over the item's leaves on each of its
    transforms (about 80 us an image here, every epoch). A class, not a lambda: a
    spawned DataLoader worker gets the dataset pickled."""

    def __init__(self, transform: Any) -> None:
        self.transform = transform

    def __call__(self, item: tuple[Any, Any]) -> tuple[Any, Any]:
        image, label = item
        return self.transform(image), label

    def __repr__(self) -> str:
        return f"OnImage({self.transform!r})"


def make_loader(
    root: str = DEFAULT_ROOT,
    images: int = 2000,
    batch_size: int = 32,
    num_workers: int = 2,
    seed: int = 0,
    side: int = 256,
    crop: int = 224,
    height: int | None = None,
    resize: int | None = None,
    cache_dir: str | None = None,
    cache_bytes: int | None = None,
) -> DataLoader[Any]:
    """The training script's DataLoader, as it was (``batchq serve`` serves it); with
    ``resize`` (or ``cache_dir``), the decoded images are resized first, and with
    ``cache_dir`` that stage is cached (:func:`resized_imagefolder`)."""
    if resize is not None or cache_dir is not None:
        dataset = resized_imagefolder(
            root, images, side, height, resize or 256, crop, cache_dir, cache_bytes
        )
    else:
        dataset = imagefolder(root, images, side, crop)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=torch.cuda.is_available(),
    )


class Net(nn.Module):
    """A small CNN for 3 x 224 x 224 images (strided, so it trains on a CPU too)."""

    def __init__(self, classes: int = CLASSES) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 7, stride=4, padding=3),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(64, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]


MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def normalise(images: torch.Tensor) -> torch.Tensor:
    """uint8 N x 3 x H x W -> float32, normalised with ImageNet's mean and std."""
    x = images.to(torch.float32).div_(255)
    return (x - MEAN.to(x.device)) / STD.to(x.device)


def _serve(n: int, args: argparse.Namespace) -> list[Any]:
    from batchq.host.procs import spawn

    argv = [sys.executable, "-m", "batchq.cli", "serve", "examples.imagefolder:make_loader"]
    argv += ["--queue", args.queue, "--hwm", "8"]
    argv += ["--arg", f"root={args.root}", "--arg", f"images={args.images}"]
    argv += ["--arg", f"batch_size={args.batch_size}", "--arg", f"side={args.side}"]
    argv += ["--arg", f"crop={args.crop}"]
    if args.height is not None:
        argv += ["--arg", f"height={args.height}"]
    if args.resize is not None:
        argv += ["--arg", f"resize={args.resize}"]
    if args.cache is not None:
        argv += ["--arg", f"cache_dir={args.cache}"]
    env = dict(os.environ)
    if args.url:
        env["BATCHQ_URL"] = args.url
    return [spawn(argv, env=env) for _ in range(n)]


def main(argv: Sequence[str] | None = None) -> int:
    """Train the CNN for ``--epochs`` on the batches producers serve."""
    from batchq.host.procs import stop_group
    from consumer import ServerDataStream
    from consumer.torch import TorchStream

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="Redis URL (default: BATCHQ_URL, localhost)")
    p.add_argument("--queue", default="images")
    p.add_argument("--root", default=DEFAULT_ROOT, help="the image folder (made if missing)")
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--side", type=int, default=256)
    p.add_argument("--crop", type=int, default=224)
    p.add_argument("--height", type=int, default=None, help="the JPEGs' height (default side)")
    p.add_argument("--resize", type=int, default=None, help="resize decoded images to this first")
    p.add_argument(
        "--cache", default=None, help="cache the decoded, resized images in this directory"
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--serve", type=int, default=0, help="start this many producers here")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--timeout-s", type=float, default=120.0, help="no producer for this long")
    args = p.parse_args(argv)
    make_folder(args.root, args.images, args.side, args.height)  # before the producers race
    procs = _serve(args.serve, args) if args.serve else []
    torch.manual_seed(0)
    model = Net().to(args.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    stream = ServerDataStream(None, False, url=args.url, queue=args.queue, timeout_s=args.timeout_s)
    try:
        with TorchStream(stream, device=args.device) as ts:
            for epoch in range(args.epochs):
                started, seen, correct, total = time.perf_counter(), 0, 0, 0.0
                for images, labels in ts:  # one epoch per iter(), as a DataLoader
                    logits = model(normalise(images))
                    loss = loss_fn(logits, labels)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    seen += len(labels)
                    correct += int((logits.argmax(1) == labels).sum())
                    total += float(loss) * len(labels)
                took = time.perf_counter() - started
                print(
                    f"epoch {epoch}: loss {total / seen:.3f}, accuracy {correct / seen:.2f}, "
                    f"{seen / took:.0f} images/s",
                    flush=True,
                )
            ts.close(finished=True)  # the producers exit 0
    finally:
        for proc in procs:
            stop_group(proc, timeout_s=30.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
