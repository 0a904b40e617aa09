"""producer.transformers.cached_mapping in one process: exactness, rejection, another
stage, the content key, the cap (tests/producer/test_fuel_cache_served.py serves it with
real processes)."""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cache_layout import disk_bytes, entries, entry_bytes, files, overwrite
from fuel_cache_pipelines import Darken, cached_stream, dataset, pipeline, uncached_stream

from batchq.errors import ConfigError
from producer.cache_store import ENTRY_OVERHEAD, DiskCache
from producer.schemes import SequentialExampleScheme
from producer.serving.sharding import ShardPlan
from producer.streams import DataStream
from producer.transformers import Mapping, cached_mapping
from producer.transformers.cached import content_digest

N = 24
Batch = tuple[bytes, ...]


def built(stream: Any, epochs: int) -> list[list[Batch]]:
    """Every batch of every epoch as a producer builds it, shard by shard (bytes)."""
    plan = ShardPlan(stream)
    return [
        [
            tuple(np.asarray(v).tobytes() for v in b)
            for s in range(plan.shards)
            for b in plan.iter_shard(e, s)
        ]
        for e in range(epochs)
    ]


def _cached(stream: Any) -> Any:
    """The CachedMapping of a pipeline (the Mapping below the crop and the batches)."""
    return stream.data_stream.data_stream.mapping


def test_the_cache_changes_no_byte_cold_or_warm_and_warm_reads_every_example(
    tmp_path: Path,
) -> None:
    want = built(uncached_stream(N), 3)
    assert want[0] != want[1]  # the crops differ from epoch to epoch
    cold = cached_stream(N, str(tmp_path))
    assert ShardPlan(cold).fingerprint == ShardPlan(uncached_stream(N)).fingerprint
    assert built(cold, 3) == want
    assert len(entries(tmp_path)) == N
    assert _cached(cold).stats["misses"] == N and _cached(cold).stats["writes"] == N
    warm = cached_stream(N, str(tmp_path))
    assert built(warm, 3) == want
    stats = _cached(warm).stats
    assert stats["misses"] == 0 and stats["hits"] == 3 * N and stats["hit_rate"] == 1.0
    assert stats["bytes_held"] == disk_bytes(tmp_path)


def test_a_corrupted_entry_a_foreign_file_and_another_stage_are_built_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = built(uncached_stream(N), 1)
    assert built(cached_stream(N, str(tmp_path)), 1) == want
    places = list(entries(tmp_path).values())
    corrupted, foreign = places[0], places[1]
    last = entry_bytes(corrupted)[-1]  # a flipped bit in the pixels: the crc catches it
    overwrite(corrupted, bytes([last ^ 0xFF]), at=corrupted.length - 1)
    assert foreign.length == places[2].length
    overwrite(foreign, entry_bytes(places[2]))  # a valid entry of another input
    again = cached_stream(N, str(tmp_path))
    assert built(again, 1) == want
    stats = _cached(again).stats
    assert stats["rejected"] == 2 and stats["misses"] == 2 and stats["hits"] == N - 2
    assert built(cached_stream(N, str(tmp_path)), 1) == want  # rewritten whole
    # Another setting of the stage is another stage: its own directory, nothing read.
    monkeypatch.setenv("TEST_DARKEN", "4")
    other = cached_stream(N, str(tmp_path))
    assert built(other, 1) == built(uncached_stream(N), 1) != want
    assert _cached(other).stats["hits"] == 0
    assert len({stage for stage, _ in entries(tmp_path)}) == 2


def test_a_cap_of_half_the_data_keeps_a_stable_half(tmp_path: Path) -> None:
    cold = cached_stream(N, str(tmp_path / "probe"))
    built(cold, 1)
    # Every entry has one size here: its frame and its index record.
    size = next(iter(entries(tmp_path / "probe").values())).length + ENTRY_OVERHEAD
    cap = size * N // 2
    stream = pipeline(cached_mapping(Darken(3), DiskCache(tmp_path / "c", cap), measure=False), N)
    want = built(uncached_stream(N), 3)
    got = built(stream, 1)
    held = {p.name: p.stat().st_mtime_ns for p in files(tmp_path / "c")}
    got += built(stream, 3)[1:]
    assert got == want
    stats = _cached(stream).stats
    assert len(entries(tmp_path / "c")) == N // 2 and stats["writes"] == N // 2
    assert {p.name: p.stat().st_mtime_ns for p in files(tmp_path / "c")} == held  # no churn
    assert disk_bytes(tmp_path / "c") <= cap


def test_the_content_key_tells_inputs_apart_and_refuses_what_it_cannot_read() -> None:
    a = np.arange(6, dtype=np.uint8)
    digests = {
        content_digest(x)
        for x in [
            (a, 1),
            (a.reshape(2, 3), 1),  # another shape
            (a.astype(np.int16), 1),  # another dtype
            [a, 1],  # a list, not a tuple
            (a, 2),
            (a, 1.0),
            {"image": a, "label": 1},
            (a.tobytes(), 1),
            (a.reshape(2, 3).T, 1),  # its values in C order differ
        ]
    }
    assert len(digests) == 9
    assert content_digest((a.reshape(3, 2).T.copy(), 1)) == content_digest((a.reshape(3, 2).T, 1))
    with pytest.raises(ConfigError, match=r"input\[1\].*cannot key a cache entry on a .*object"):
        content_digest((a, object()))


def test_a_mapping_is_named_by_its_code_and_settings(tmp_path: Path) -> None:
    def third(x: Any) -> Any:
        return x // 3

    fingerprints = {
        cached_mapping(f, DiskCache(tmp_path)).fingerprint
        for f in (Darken(2), Darken(3), third, lambda x: x // 2)
    }
    assert len(fingerprints) == 4
    assert (
        cached_mapping(Darken(2), DiskCache(tmp_path)).fingerprint
        == cached_mapping(Darken(2), DiskCache(tmp_path)).fingerprint
    )

    class Opaque:  # its repr is '<...Opaque object at 0x...>': per process
        def __call__(self, x: Any) -> Any:
            return x

    with pytest.raises(ConfigError, match=r"memory address.*cached_mapping\(\), naming"):
        cached_mapping(Opaque(), DiskCache(tmp_path))
    keyed = cached_mapping(Opaque(), DiskCache(tmp_path, key="opaque-v1"), measure=False)
    first, again = keyed((np.ones(2), 1)), keyed((np.ones(2), 1))
    assert (again[0] == first[0]).all() and again[1] == first[1] == 1
    assert keyed.stats["hits"] == 1
    # A key given to the wrapper names that stage alone, and wins over the cache's.
    own = cached_mapping(Opaque(), DiskCache(tmp_path, key="opaque-v1"), key="own", measure=False)
    assert own.fingerprint != keyed.fingerprint
    assert own.fingerprint == cached_mapping(Opaque(), DiskCache(tmp_path), key="own").fingerprint
    own((np.ones(2), 1))
    assert own.stats["hits"] == 0  # not the other stage's entry


def test_a_cached_mapping_pickles_and_starts_afresh_in_its_new_process(tmp_path: Path) -> None:
    f = cached_mapping(Darken(3), DiskCache(tmp_path), measure=False)
    f((np.ones(2, np.uint8), 1))
    copy = pickle.loads(pickle.dumps(f))  # as a DataLoader's spawned worker gets it
    assert copy.fingerprint == f.fingerprint and copy.stats["misses"] == 0
    image, label = copy((np.ones(2, np.uint8), 1))
    assert copy.stats["hits"] == 1 and label == 1 and image.tolist() == [0, 0]


def _brighter(example: dict[str, Any]) -> dict[str, Any]:
    return {"image": example["image"] // 2 + 10, "label": example["label"]}


def test_a_mapping_that_accepts_dicts_is_cached_too(tmp_path: Path) -> None:
    def stream(stage: Any) -> Any:
        base = DataStream(dataset(N), iteration_scheme=SequentialExampleScheme(N))
        return Mapping(base, stage, mapping_accepts=dict)

    want = [_bytes(x) for x in stream(_brighter).get_epoch_iterator()]
    for _ in range(2):  # cold, then warm
        cached = cached_mapping(_brighter, DiskCache(tmp_path), measure=False)
        assert [_bytes(x) for x in stream(cached).get_epoch_iterator()] == want
    assert cached.stats["hits"] == N and cached.stats["misses"] == 0


def _bytes(example: Any) -> Batch:
    return tuple(np.asarray(v).tobytes() for v in example)


def test_a_stage_that_draws_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def noisy(x: Any) -> Any:
        return x + np.random.randint(3)

    f = cached_mapping(noisy, DiskCache(tmp_path), measure=False)
    with caplog.at_level(logging.WARNING, logger="producer.cache_stage"):
        f(np.zeros(2)), f(np.ones(2))
    assert sum("drew from numpy's" in r.getMessage() for r in caplog.records) == 1


def test_a_producer_without_torch_imports_the_fuel_cache(spawn_proc: Any) -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any import of torch fails
        "import producer, producer.transformers.cached, producer.cache_store\n"
        "print('ok')"
    )
    root = Path(__file__).resolve().parents[2]  # `python -c` imports from its cwd
    proc = spawn_proc(
        [sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip() == "ok"
