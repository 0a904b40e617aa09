"""Fuel 0.2.0's own ZeroMQ data server, as a same-run baseline (never a batchq dependency).

:func:`fuel_python` builds Fuel 0.2.0 from the registry's sdist in a throwaway
virtualenv (default ``/tmp/batchq-fuel-0.2.0``, reused once built): on Python 3.11 its
optional Cython image extension does not compile and is not needed, and a few names
moved since 2016, so the unpacked source is patched before installing it without its
extension:

* ``collections.Iterable`` / ``collections.Iterator`` (also imported from
  ``collections``) -> ``collections.abc``
* ``numpy.bool`` -> ``numpy.bool_``
* ``ndarray.tostring()`` -> ``ndarray.tobytes()``

then its declared requirements (pyzmq, six, picklable-itertools, pyyaml, h5py, tables,
progressbar2, scipy, pillow, requests) are installed into the same virtualenv.

Run with that virtualenv's Python, this file is the two sides of the baseline::

    python fuel_baseline.py serve PORT SHAPE DTYPE BATCHES HWM    # fuel.server.start_server
    python fuel_baseline.py receive PORT SHAPE HWM COUNT SECONDS  # fuel.streams.ServerDataStream

``receive`` prints one JSON line: batches received after the first, seconds, and the
CPU seconds this process used.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

DEFAULT_VENV = Path("/tmp/batchq-fuel-0.2.0")
REQUIREMENTS = [
    "numpy<2", "six", "picklable-itertools", "pyyaml", "h5py", "tables", "progressbar2",
    "pyzmq", "scipy", "pillow", "requests",
]  # fmt: skip
PATCHES = [
    (r"from collections import (Iterable|Iterator)\b", r"from collections.abc import \1"),
    (r"collections\.(Iterable|Iterator)\b", r"collections.abc.\1"),
    (r"numpy\.bool\b(?!_)", "numpy.bool_"),
    (r"\.tostring\(\)", ".tobytes()"),
]


def _run(argv: list[str], log: Path) -> None:
    with open(log, "a") as out:
        subprocess.run(argv, check=True, stdout=out, stderr=subprocess.STDOUT)


def fuel_python(venv: Path = DEFAULT_VENV) -> Path:
    """The Python of a virtualenv with Fuel 0.2.0 installed (built on first use).

    Raises:
        subprocess.CalledProcessError: a step failed; its output is in venv/build.log.
    """
    python = venv / "bin" / "python"
    if python.exists() and (venv / ".fuel-ok").exists():
        return python
    venv.mkdir(parents=True, exist_ok=True)
    log = venv / "build.log"
    print(f"building Fuel 0.2.0 in {venv} (log: {log}) ...", flush=True)
    _run([sys.executable, "-m", "venv", str(venv)], log)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "-q"]
    src = venv / "src"
    src.mkdir(exist_ok=True)
    _run(
        [*pip, "download", "fuel==0.2.0", "--no-deps", "--no-binary", ":all:", "-d", str(src)], log
    )
    with tarfile.open(src / "fuel-0.2.0.tar.gz") as tar:
        tar.extractall(src, filter="data")
    root = src / "fuel-0.2.0"
    for path in root.rglob("*.py"):
        text = path.read_text()
        patched = text
        for pattern, repl in PATCHES:
            patched = re.sub(pattern, repl, patched)
        if path.name == "setup.py":  # no Cython image extension (not needed here)
            patched = re.sub(r"ext_modules=\[Extension\(.*?\)\]", "", patched, flags=re.S)
        if patched != text:
            path.write_text(patched)
    _run([*pip, "install", "setuptools", "wheel", *REQUIREMENTS], log)
    _run(
        [*pip, "install", "--force-reinstall", "--no-deps", "--no-build-isolation", str(root)], log
    )
    check = "import fuel.server, fuel.streams, fuel.datasets, fuel.schemes, fuel.transformers"
    _run([str(python), "-c", check], log)
    (venv / ".fuel-ok").write_text("ok\n")
    return python


# --------------------------------------------------------------------------- in the venv


def _serve(port: int, shape: tuple[int, ...], dtype: str, batches: int, hwm: int) -> None:
    import logging

    import numpy
    from fuel.datasets import Dataset
    from fuel.schemes import ConstantScheme
    from fuel.server import start_server
    from fuel.streams import DataStream

    batch = (numpy.arange(int(numpy.prod(shape))) % 251).astype(dtype).reshape(shape)

    class Constant(Dataset):  # type: ignore[misc]
        provides_sources = ("x",)

        def get_data(self, state: Any = None, request: Any = None) -> Any:
            return (batch,)

    stream = DataStream(Constant(), iteration_scheme=ConstantScheme(shape[0], times=batches))
    logging.disable(logging.INFO)  # start_server logs every batch at INFO otherwise
    start_server(stream, port=port, hwm=hwm)


def _receive(port: int, hwm: int, count: int, seconds: float) -> None:
    from fuel.streams import ServerDataStream

    stream = ServerDataStream(("x",), produces_examples=False, port=port, hwm=hwm)

    def batches() -> Any:
        while True:
            yield from stream.get_epoch_iterator()

    it = batches()
    next(it)
    cpu0, t0, n = time.process_time(), time.perf_counter(), 0
    while n < count and time.perf_counter() - t0 < seconds:
        next(it)
        n += 1
    dt, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    print(json.dumps({"batches": n, "seconds": dt, "cpu_s": cpu}), flush=True)
    os._exit(0)  # fuel's ZeroMQ context would wait for the server otherwise


def main(argv: list[str]) -> int:
    """The serve / receive sides, run by the Fuel virtualenv's Python."""
    if argv and argv[0] == "build":
        print(fuel_python(Path(argv[1]) if len(argv) > 1 else DEFAULT_VENV))
        return 0
    if argv and argv[0] == "serve":
        port, shape, dtype, batches, hwm = argv[1:6]
        _serve(int(port), tuple(int(d) for d in shape.split(",")), dtype, int(batches), int(hwm))
        return 0
    if argv and argv[0] == "receive":
        port, _shape, hwm, count, seconds = argv[1:6]
        _receive(int(port), int(hwm), int(count), float(seconds))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
