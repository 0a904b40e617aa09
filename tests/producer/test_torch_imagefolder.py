"""examples/imagefolder.py end to end, small: JPEGs made with PIL, torchvision's
ImageFolder and v2 transforms served by a producer, a CNN trained through TorchStream."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from producer.torch import import_torchvision  # noqa: E402

try:
    import_torchvision()
except ImportError as e:  # pragma: no cover - a machine without torchvision
    pytest.skip(f"torchvision cannot be imported here: {e}", allow_module_level=True)

from examples.imagefolder import imagefolder, make_folder  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_the_folder_is_made_once(tmp_path: Path) -> None:
    root = make_folder(tmp_path / "img", images=8, side=32)
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.jpg"))
    assert len(files) == 8 and files[0] == "class0/00000.jpg"
    stamp = (root / "class0" / "00000.jpg").stat().st_mtime_ns
    make_folder(root, images=8, side=32)
    assert (root / "class0" / "00000.jpg").stat().st_mtime_ns == stamp
    image, label = imagefolder(str(root), images=8, side=32, crop=24)[5]
    assert image.shape == (3, 24, 24) and image.dtype == torch.uint8 and label == 2  # 2 a class


def test_the_example_trains_through_a_served_imagefolder(
    redis_url: str, queue_name: str, tmp_path: Path, serve_env: Any, spawn_proc: Any
) -> None:
    argv = [sys.executable, "-m", "examples.imagefolder", "--url", redis_url, "--queue", queue_name]
    argv += ["--root", str(tmp_path / "img"), "--images", "32", "--side", "64", "--crop", "48"]
    argv += ["--batch-size", "8", "--epochs", "2", "--serve", "1", "--timeout-s", "20"]
    env = serve_env()
    env["PYTHONPATH"] = f"{REPO}:{env['PYTHONPATH']}"
    proc = spawn_proc(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0, err.decode()[-3000:]
    lines = [line for line in out.decode().splitlines() if line.startswith("epoch")]
    assert [line.split(":")[0] for line in lines] == ["epoch 0", "epoch 1"]
    assert all("images/s" in line for line in lines)
