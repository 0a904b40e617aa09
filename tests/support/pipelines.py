"""Pipelines the tests serve, importable by producer processes (``batchq serve``).

Each example's features are ``index * FEATURES + arange(FEATURES)``, so a batch tells
which examples it holds: ``batch[:, 0] // FEATURES``.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

import numpy as np

from batchq.cli.demo import Bottleneck
from batchq.protocol.params_log import thaw
from producer import control
from producer.datasets import IndexableDataset
from producer.mixture import Mixture
from producer.schemes import SequentialScheme, ShuffledScheme
from producer.streams import DataStream
from producer.transformers import Filter, Mapping, Transformer

FEATURES = 8


def examples_of(batch: np.ndarray) -> list[int]:
    """The example indices a batch of ``features`` holds."""
    return [int(v) // FEATURES for v in batch[:, 0]]


# The tutorial's Bottleneck (a fixed loading delay per batch), as the demo defines it.
Slow = Bottleneck


class Padded:
    """A mapping (for :class:`Mapping`) that adds a ``pad`` source of ``nbytes`` zero bytes
    per batch: frames of a realistic size (the trainer need not ask for it)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __call__(self, data: tuple[Any, ...]) -> tuple[np.ndarray]:
        rows = len(data[0])
        return (np.zeros((rows, max(1, self.nbytes // rows)), dtype=np.uint8),)


class FailOnExample(Transformer):
    """Raises RuntimeError when a batch holds example ``bad``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.bad = kwargs.pop("bad")
        super().__init__(*args, **kwargs)

    def get_data(self, request: Any = None) -> Any:
        batch = next(self.child_epoch_iterator)
        if self.bad in examples_of(batch[0]):
            raise RuntimeError(f"example {self.bad} is poisoned")
        return batch


def slot_shares(plan: list[list[int]], per_shard: int, world: int) -> list[list[list[int]]]:
    """Each rank's share of an epoch whose shards hold ``per_shard`` batches each (pad:
    a slot past S rebuilds shard (s - S) % S), in plan order."""
    cut = [plan[i : i + per_shard] for i in range(0, len(plan), per_shard)]
    slots = -(-len(cut) // world) * world
    return [
        [
            b
            for s in range(r, slots, world)
            for b in cut[s if s < len(cut) else (s - len(cut)) % len(cut)]
        ]
        for r in range(world)
    ]


def numbered(
    examples: int | None = None,
    batch_size: int | None = None,
    shuffled: bool = True,
    seed: int | None = None,
) -> Any:
    """A stream of numbered examples; unset arguments come from TEST_* variables."""
    examples = examples or int(os.environ.get("TEST_EXAMPLES", "200"))
    batch_size = batch_size or int(os.environ.get("TEST_BATCH_SIZE", "20"))
    if seed is None:
        seed = int(os.environ.get("TEST_SEED", "1"))
    features = np.arange(examples * FEATURES, dtype=np.int64).reshape(examples, FEATURES)
    dataset = IndexableDataset({"features": features, "targets": np.arange(examples)})
    scheme: Any
    if shuffled:
        scheme = ShuffledScheme(examples=examples, batch_size=batch_size, rng=seed)
    else:
        scheme = SequentialScheme(examples=examples, batch_size=batch_size)
    stream: Any = DataStream.default_stream(dataset, iteration_scheme=scheme)
    slow_ms = float(os.environ.get("TEST_SLOW_MS", "0"))
    if slow_ms:
        stream = Slow(stream, slowdown=slow_ms / 1000)
    pad_bytes = int(os.environ.get("TEST_PAD_BYTES", "0"))
    if pad_bytes:
        stream = Mapping(stream, Padded(pad_bytes), add_sources=("pad",))
    bad = os.environ.get("TEST_BAD_EXAMPLE")
    if bad is not None:
        stream = FailOnExample(stream, bad=int(bad))
    build_log = os.environ.get("TEST_BUILD_LOG")
    if build_log:
        stream = Mapping(stream, BuildLog(build_log))
    draw_log = os.environ.get("TEST_DRAW_LOG")
    if draw_log:
        stream = Mapping(stream, DrawLog(draw_log))
    return stream


def kept(data: tuple[Any, ...]) -> bool:
    """:func:`filtered`'s predicate: a batch whose first example's number (its target) is
    not a multiple of 3."""
    return int(data[1][0]) % 3 != 0


def filtered() -> Any:
    """:func:`numbered`'s batches less those :func:`kept` refuses: shards of several
    requests then hold numbers of batches that the plan cannot count."""
    return Filter(numbered(), kept)


class DrawLog:
    """A mapping (for :class:`Mapping`) that appends, per batch built, the building
    process's pid and one draw of Python's and of numpy's global generators, as JSON:
    what tells whether two producer processes share a random state."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, data: tuple[Any, ...]) -> tuple[Any, ...]:
        draw = {
            "pid": os.getpid(),
            "random": random.random(),
            "numpy": int(np.random.randint(2**62)),
        }
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (json.dumps(draw) + "\n").encode())
        finally:
            os.close(fd)
        return data


class BuildLog:
    """A mapping (for :class:`Mapping`) that appends one line per batch the pipeline
    builds to a file: the example indices it holds, as JSON (one ``write`` of a short
    line in append mode: producers in several processes may share the file). What a
    test counts builds by, whatever happens to the frame afterwards."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, data: tuple[Any, ...]) -> tuple[Any, ...]:
        line = json.dumps(examples_of(data[0])) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
        return data


def builds(path: str) -> list[tuple[int, ...]]:
    """The batches a :class:`BuildLog` recorded, in order (their example indices)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [tuple(json.loads(line)) for line in f if line.strip()]


def slow_start() -> Any:
    """:func:`numbered`, made slowly: says so on stderr, then takes TEST_FACTORY_S
    seconds (60) first, as a factory that imports and probes a large dataset does."""
    print("factory called", file=sys.stderr, flush=True)
    time.sleep(float(os.environ.get("TEST_FACTORY_S", "60")))
    return numbered()


def fuel_tutorial(slowdown: float = 0.0) -> Any:
    """Fuel's server page, as written there (``create_data_stream``): a list of lists
    (1000 examples of 128 zeros) in shuffled batches of 100, behind a Bottleneck."""
    dataset = IndexableDataset({"features": [[0] * 128] * 1000})
    iteration_scheme = ShuffledScheme(examples=1000, batch_size=100)
    return Bottleneck(
        data_stream=DataStream.default_stream(dataset=dataset, iteration_scheme=iteration_scheme),
        slowdown=slowdown,
    )


def params_json(params: Any) -> str:
    """Params as the steered pipeline writes them into a batch: JSON, sorted keys."""
    return json.dumps(thaw(params), sort_keys=True)


class WithParams:
    """A mapping (for :class:`Mapping`) that adds a ``params`` source: the params in
    effect for the batch being built (``control.params()``), as :func:`params_json`."""

    def __call__(self, data: tuple[Any, ...]) -> tuple[str]:
        return (params_json(control.params()),)


def steered(examples: int | None = None, batch_size: int | None = None) -> Any:
    """:func:`numbered`, each batch adding the params it was built with (``params``)."""
    return Mapping(numbered(examples, batch_size), WithParams(), add_sources=("params",))


def mixture() -> Any:
    """A mixture of two numbered sources ('a': a Fuel dataset of TEST_A_EXAMPLES, 'b': a
    list of dicts of TEST_B_EXAMPLES, numbered from 10000), weights {a: 1, b: 0}."""
    n_a = int(os.environ.get("TEST_A_EXAMPLES", "30"))
    n_b = int(os.environ.get("TEST_B_EXAMPLES", "20"))
    a = IndexableDataset({"x": np.arange(n_a, dtype=np.int64)})
    b = [{"x": np.int64(10_000 + i)} for i in range(n_b)]
    return Mixture(
        {"a": a, "b": b},
        {"a": 1.0, "b": 0.0},
        batch_size=int(os.environ.get("TEST_BATCH_SIZE", "8")),
        batches_per_epoch=int(os.environ.get("TEST_BATCHES", "25")),
        seed=int(os.environ.get("TEST_SEED", "7")),
    )
