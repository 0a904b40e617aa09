"""producer.torch.cached in one process: entries, exactness, rejection, the cap, the
measurement (tests/producer/test_torch_cache_served.py serves it with real processes)."""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cache_layout import disk_bytes, entries, entry_bytes, files, overwrite, stage_dirs  # noqa: E402
from cache_pipelines import (  # noqa: E402
    Stage,
    cached_stream,
    jitter_image,
    stage,
    uncached_stream,
)

from batchq.errors import ConfigError  # noqa: E402
from producer import cache_stage, cache_store  # noqa: E402
from producer.cache_entry import decode_entry, encode_entry  # noqa: E402
from producer.cache_segment import pack_record, segment_name  # noqa: E402
from producer.cache_store import ENTRY_OVERHEAD, DiskCache  # noqa: E402
from producer.serving.sharding import ShardPlan  # noqa: E402
from producer.torch import cache as torch_cache  # noqa: E402
from producer.torch import cached  # noqa: E402
from producer.torch.randomness import seed_globals  # noqa: E402

N = 40

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


def test_an_entry_gives_back_the_example_its_types_and_its_layout() -> None:
    from producer.torch import import_torchvision
    from producer.torch.cache import _TENSORS  # the tensors' leaf codec

    import_torchvision()
    from torchvision import tv_tensors

    hwc = torch.arange(2 * 3 * 3, dtype=torch.uint8).reshape(2, 3, 3)
    example = {
        "image": tv_tensors.Image(hwc.permute(2, 0, 1)),  # a CHW view, as ToImage makes
        "plain": torch.ones(2, dtype=torch.float64),
        "pair": (np.arange(6, dtype=">i4").reshape(2, 3).T, np.float32(0.5)),
        "list": [1, 2.5, True, None, "s", b"b"],
    }
    entry = bytes(encode_entry(example, "f" * 64, 7, _TENSORS))
    got = decode_entry(entry, "f" * 64, 7, _TENSORS)
    assert list(got) == list(example)
    assert type(got["image"]) is type(example["image"])
    assert got["image"].stride() == example["image"].stride()
    assert torch.equal(got["image"], example["image"])
    assert type(got["plain"]) is torch.Tensor and torch.equal(got["plain"], example["plain"])
    arr, scalar = got["pair"]
    assert isinstance(got["pair"], tuple) and arr.dtype == np.dtype(">i4")
    assert arr.strides == example["pair"][0].strides and (arr == example["pair"][0]).all()
    assert type(scalar) is np.float32 and scalar == 0.5
    assert got["list"] == example["list"] and [type(v) for v in got["list"]] == [
        type(v) for v in example["list"]
    ]
    got["plain"].add_(1)  # writable: an augmentation may work in place


def test_what_an_entry_cannot_hold_is_refused_naming_it_and_its_place(tmp_path: Path) -> None:
    from PIL import Image

    with pytest.raises(ConfigError, match=r"example\[0\]: cannot cache a PIL.*ToImage"):
        encode_entry((Image.new("RGB", (4, 4)), 1), "f" * 64, 0)
    with pytest.raises(ConfigError, match="dict key 3 is not a str"):
        encode_entry({3: np.zeros(2)}, "f" * 64, 0)
    with pytest.raises(ConfigError, match="bfloat16"):
        cached(_Listed([torch.zeros(2, dtype=torch.bfloat16)]), cache=DiskCache(tmp_path))[0]


def test_cached_epochs_are_the_uncached_pipelines_bytes_cold_and_warm(tmp_path: Path) -> None:
    want = built(uncached_stream(N), 3)
    assert want[0] != want[1]  # the augmentation differs from epoch to epoch
    cold = cached_stream(N, str(tmp_path))
    assert built(cold, 3) == want
    # The probe (which names the sources) reads epoch 0's first example once more.
    assert cold.dataset.stats["misses"] == N and cold.dataset.stats["hits"] == 2 * N + 1
    warm = cached_stream(N, str(tmp_path))  # a new process would find the same entries
    assert built(warm, 3) == want
    assert warm.dataset.stats["hits"] == 3 * N + 1 and warm.dataset.stats["misses"] == 0
    assert len(entries(tmp_path)) == N


def test_a_dataloader_reads_batches_of_the_uncached_pipelines_bytes_cold_and_warm(
    tmp_path: Path,
) -> None:
    # A DataLoader reads a batch through __getitems__: its entries are stored together,
    # and the examples (augment draws included, in order) are those of dataset[i].
    def epoch(dataset: Any) -> list[bytes]:
        seed_globals(3)  # torch's, numpy's and Python's generators: augment draws from each
        loader = torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True)
        return [np.asarray(v).tobytes() for b in loader for v in b]

    want = epoch(_Augmented(stage(N)))
    cold = cached(stage(N), augment=jitter_image, cache=DiskCache(tmp_path))
    assert epoch(cold) == want
    assert (cold.stats["writes"], cold.stats["misses"]) == (N, N)
    warm = cached(stage(N), augment=jitter_image, cache=DiskCache(tmp_path))
    assert epoch(warm) == want and warm.stats["hits"] == N
    assert len(entries(tmp_path)) == N


def test_an_augment_that_changes_its_item_in_place_leaves_the_entries_whole(
    tmp_path: Path,
) -> None:
    # The augment runs once the batch's entries are written: one that changes the item
    # in place (legal over a stage that makes each item anew) cannot reach their bytes
    # (a reviewer's bad_checksum on the read-back, and entries rejected every epoch).
    def doubled(item: Any) -> Any:
        return item[0].mul_(2), item[1]

    want = [np.asarray(v).tobytes() for i in range(N) for v in doubled(stage(N)[i])]
    ds = cached(stage(N), augment=doubled, cache=DiskCache(tmp_path))
    for epoch in range(3):
        got = [
            np.asarray(v).tobytes()
            for b in range(0, N, 8)
            for item in ds.__getitems__(list(range(b, min(b + 8, N))))
            for v in item
        ]
        assert got == want, epoch
    assert (ds.stats["misses"], ds.stats["hits"], ds.stats["rejected"]) == (N, 2 * N, 0)


def test_an_index_a_batch_holds_again_is_built_once(tmp_path: Path) -> None:
    ds = cached(stage(N), cache=DiskCache(tmp_path))
    items = ds.__getitems__([3, 3, 5, 3])
    assert [int(item[1]) for item in items] == [3, 3, 5, 3]
    assert (ds.stats["misses"], ds.stats["writes"], ds.stats["hits"]) == (2, 2, 2)
    assert len(entries(tmp_path)) == 2


class _Augmented(torch.utils.data.Dataset):  # type: ignore[misc]
    """The stage, then the augmentation: the pipeline without the cache."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        return jitter_image(self.dataset[i])


def test_torn_corrupted_and_foreign_entries_are_rebuilt_never_served(tmp_path: Path) -> None:
    other_dir, tmp_path = tmp_path / "other", tmp_path / "main"
    ds = cached(stage(N), augment=jitter_image, cache=DiskCache(tmp_path), measure=False)
    want = [_seeded(ds.dataset, i) for i in range(N)]
    for i in range(N):
        ds[i]  # every entry written
    # Each entry damaged in its segment, as a disk, a crash or another program would.
    places = {i: p for (_, i), p in entries(tmp_path).items()}
    torn = places[1]
    overwrite(torn, bytes(100), at=torn.length - 100)  # torn: its last bytes never written
    flipped = places[2]
    last = entry_bytes(flipped)[-1]
    overwrite(flipped, bytes([last ^ 0xFF]), at=flipped.length - 1)  # one flipped bit of pixels
    overwrite(places[3], b"not a frame at all")  # foreign
    assert places[4].length == places[5].length
    overwrite(places[4], entry_bytes(places[5]))  # another index's entry
    other = cached(stage(N, brighten=5), cache=DiskCache(other_dir), measure=False)
    other[6]
    (theirs,) = entries(other_dir).values()
    assert theirs.length == places[6].length
    overwrite(places[6], entry_bytes(theirs))  # another stage's entry
    fresh = cached(stage(N), augment=jitter_image, cache=DiskCache(tmp_path), measure=False)
    got = [_seeded(fresh, i) for i in range(N)]
    assert all(_same(g, w) for g, w in zip(got, want, strict=True))
    assert fresh.stats["rejected"] == 5 and fresh.stats["hits"] == N - 5
    assert fresh.stats["writes"] == 5  # built again and stored again
    again = cached(stage(N), augment=jitter_image, cache=DiskCache(tmp_path), measure=False)
    assert all(_same(_seeded(again, i), want[i]) for i in range(N))
    assert again.stats["hits"] == N and again.stats["rejected"] == 0


def test_a_changed_stage_is_another_fingerprint_and_a_key_names_one(tmp_path: Path) -> None:
    first = cached(stage(N), cache=DiskCache(tmp_path), measure=False)
    changed = cached(stage(N, brighten=3), cache=DiskCache(tmp_path), measure=False)
    assert first.fingerprint != changed.fingerprint
    first[0]
    assert torch.equal(changed[0][0], stage(N, brighten=3)[0][0])  # not the first's entry
    assert changed.stats["misses"] == 1 and changed.stats["hits"] == 0
    keyed = [cached(stage(N, b), cache=DiskCache(tmp_path, key="v1")) for b in (2, 3)]
    assert keyed[0].fingerprint == keyed[1].fingerprint  # the user's key names the stage
    longer = cached(stage(N + 1), cache=DiskCache(tmp_path, key="v1"))
    assert longer.fingerprint != keyed[0].fingerprint  # the length is in it still
    # A function is named by its module, qualname and source: the same in every process.
    halve = cached(Stage(N, lambda x: x // 2), cache=DiskCache(tmp_path))
    third = cached(Stage(N, lambda x: x // 3), cache=DiskCache(tmp_path))
    assert halve.fingerprint != third.fingerprint

    class Opaque:  # its repr is '<...Opaque object at 0x...>': per process
        def __call__(self, x: Any) -> Any:
            return x

    with pytest.raises(ConfigError, match=r"memory address.*pass key=\.\.\. to cached\(\)"):
        cached(Stage(N, Opaque()), cache=DiskCache(tmp_path))


def test_a_key_given_to_cached_names_that_stage_alone(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path)  # one cache, two stages of one length: train and val
    train = cached(stage(N, 2), cache=cache, key="train-v1", measure=False)
    val = cached(stage(N, 3), cache=cache, key="val-v1", measure=False)
    assert train.fingerprint != val.fingerprint
    for ds, brighten in ((train, 2), (val, 3), (train, 2), (val, 3)):
        assert torch.equal(ds[0][0], stage(N, brighten)[0][0])  # never the other's entry
    assert train.stats["hits"] == val.stats["hits"] == 1
    # The stage's key wins over the cache's, which names every stage of that cache.
    both = cached(stage(N, 2), cache=DiskCache(tmp_path, key="all"), key="train-v1")
    assert both.fingerprint == train.fingerprint
    assert cached(Stage(N, lambda x: x), cache=cache, key="opaque-v1").fingerprint
    for key in ("", 3):
        with pytest.raises(ConfigError, match=rf"key={key!r} is not valid"):
            cached(stage(N), cache=cache, key=key)  # type: ignore[arg-type]


def _brighten(k: int) -> Any:
    def brighten(x: Any) -> Any:
        return x * k

    return brighten


def test_subsets_splits_and_closures_are_stages_of_their_own(tmp_path: Path) -> None:
    from torch.utils.data import ConcatDataset, Subset, random_split

    whole = stage(N)
    train, val = random_split(whole, [N // 2, N // 2], generator=torch.Generator().manual_seed(0))
    named = [cached(part, cache=DiskCache(tmp_path), measure=False) for part in (train, val)]
    assert named[0].fingerprint != named[1].fingerprint  # the two halves of one split
    for ds, part in ((named[0], train), (named[1], val), (named[1], val)):
        (image, label), (want, wanted) = ds[3], part[3]
        assert torch.equal(image, want) and label == wanted
    assert named[1].stats["hits"] == 1  # its own entry, not the train half's
    other_root = Subset(stage(N, brighten=3), list(range(N // 2)))
    first = Subset(whole, list(range(N // 2)))
    assert cached(first).fingerprint != cached(other_root).fingerprint  # what it holds
    both = [cached(ConcatDataset([whole, p])).fingerprint for p in (train, val)]
    assert both[0] != both[1]
    # A closure's values name it: brighten(2) and brighten(3) share their source.
    halves = [cached(Stage(N, _brighten(k))).fingerprint for k in (2, 3)]
    assert halves[0] != halves[1]


def test_a_cache_directory_that_cannot_be_opened_builds_every_item(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")  # a file where the cache's parent folder would be (as root too)
    ds = cached(stage(N), cache=DiskCache(blocker / "cache"), measure=False)
    with caplog.at_level(logging.WARNING, logger="producer.cache_store"):
        for i in (0, 1, 0):
            assert torch.equal(ds[i][0], stage(N)[i][0])
    assert ds.stats["hits"] == 0 and ds.stats["misses"] == 3 and ds.stats["writes"] == 0
    assert len([r for r in caplog.records if "cannot be used" in r.message]) == 1


def test_a_cap_of_half_the_data_keeps_a_stable_half(tmp_path: Path) -> None:
    # An entry's bytes: its frame and its index record.
    size = len(encode_entry(stage(N)[0], "f" * 64, 0, torch_cache._TENSORS)) + ENTRY_OVERHEAD
    cap = size * N // 2
    stream = _capped_stream(tmp_path, cap)
    want = built(uncached_stream(N), 3)
    plan, ds = ShardPlan(stream), stream.dataset
    counts = []
    for e in range(3):
        shards = [plan.iter_shard(e, s) for s in range(plan.shards)]
        got = [tuple(np.asarray(v).tobytes() for v in b) for shard in shards for b in shard]
        assert got == want[e]
        counts.append((ds.stats["hits"], ds.stats["writes"]))
        assert disk_bytes(tmp_path) <= cap
    held = {p.name: p.stat().st_mtime_ns for p in files(tmp_path)}
    # Epoch 1 (and the probe batch) writes until the cap.
    assert len(entries(tmp_path)) == counts[0][1] == N // 2
    # Then half the examples hit each epoch, and nothing is written again.
    assert counts[1] == (counts[0][0] + N // 2, N // 2)
    assert counts[2] == (counts[1][0] + N // 2, N // 2)
    assert {p.name: p.stat().st_mtime_ns for p in files(tmp_path)} == held  # no churn
    assert ds.stats["bytes_held"] == disk_bytes(tmp_path) <= cap


def test_a_killed_writers_leftovers_are_removed_and_the_ledger_recounted(tmp_path: Path) -> None:
    ds = cached(stage(N), cache=DiskCache(tmp_path, max_bytes=10**6), measure=False)
    for i in range(4):
        ds[i]
    stage_dir = stage_dirs(tmp_path)[0]
    host = cache_store.HOST  # the host part of this host's segments' names
    # A writer killed mid-write: entry 9 written and indexed, then a reservation of which
    # only the first bytes were written (no record points at them).
    whole = bytes(encode_entry(stage(N)[9], ds.fingerprint, 9, torch_cache._TENSORS))
    killed = stage_dir / segment_name(0xDEAD, _unused_pid(), host)
    killed.write_bytes(whole + b"BQF half an entry" + bytes(70000))
    with open(stage_dir / "index.bqi", "ab") as index:
        index.write(pack_record(9, 0xDEAD, 0, len(whole)))
    writing = stage_dir / segment_name(0xBEEF, os.getpid(), host)
    writing.write_bytes(bytes(50000))  # a live writer's reservation, its record to come
    live = os.open(writing, os.O_RDONLY)
    fcntl.flock(live, fcntl.LOCK_SH)  # what keeps a writer's segment from a recount
    (tmp_path / ".bytes").write_bytes(b"00000000000099999999\n")  # reserved and lost
    again = cached(stage(N), cache=DiskCache(tmp_path, max_bytes=10**6), measure=False)
    again[11]
    sealed = stage_dir / segment_name(0xDEAD)
    assert not killed.exists() and sealed.read_bytes() == whole  # trimmed to its entry
    assert writing.exists() and writing.stat().st_size == 50000
    held = disk_bytes(tmp_path)  # every file: the live writer's reservation with them
    assert again.stats["bytes_held"] == held
    assert int((tmp_path / ".bytes").read_bytes()) == held
    assert _same(again[9], stage(N)[9])
    assert again.stats["hits"] == 1  # entry 9, read from the sealed segment
    os.close(live)


def _unused_pid() -> int:
    """A pid no process has now (from the top of the range, where pids are rarely used)."""
    top = int(Path("/proc/sys/kernel/pid_max").read_text())
    for pid in range(top - 1, top - 10000, -1):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    pytest.fail("no unused pid found")


class _Clock:
    """A clock the test moves: builds and reads cost what the test says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Timed(DiskCache):
    def __init__(self, clock: _Clock, read_s: float, directory: Path) -> None:
        super().__init__(directory)
        self.clock, self.read_s = clock, read_s

    def read(self, stage: str, index: int) -> bytearray | None:
        self.clock.now += self.read_s
        return super().read(stage, index)


class _Listed:
    """A dataset in memory; each item costs ``build_s`` on the test's clock."""

    def __init__(self, items: list[Any], clock: _Clock | None = None, build_s: float = 0) -> None:
        self.items, self.clock, self.build_s = items, clock, build_s

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        if self.clock is not None:
            self.clock.now += self.build_s
        return self.items[i]


@pytest.mark.parametrize(
    ("build_s", "read_s", "bypassed"), [(1e-6, 1e-4, True), (5e-3, 1e-4, False)]
)
def test_the_cache_is_used_where_a_read_is_faster_than_a_build(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    build_s: float,
    read_s: float,
    bypassed: bool,
) -> None:
    clock = _Clock()
    monkeypatch.setattr(cache_stage, "clock", clock)
    items = [np.full(3, i) for i in range(30)]
    ds = cached(_Listed(items, clock, build_s), lambda x: x * 2, _Timed(clock, read_s, tmp_path))
    with caplog.at_level(logging.INFO, logger="producer.cache_stage"):
        for _ in range(2):
            assert all((ds[i] == items[i] * 2).all() for i in range(len(items)))
    assert ds.stats["bypassed"] is bypassed
    said = [r for r in caplog.records if "does not pay" in r.getMessage()]
    assert len(said) == (1 if bypassed else 0)
    if bypassed:  # judged within the first epoch: entries read back as they were written
        assert ds.stats["writes"] == cache_stage.READ_BACK and ds.stats["hits"] == 0
    else:
        assert ds.stats["hits"] == len(items) and ds.stats["saved_s"] > 0


def _seeded(ds: Any, i: int) -> Any:
    seed_globals(1000 + i)  # as a producer seeds before a batch
    return ds[i] if not isinstance(ds, Stage) else jitter_image(ds[i])


def _same(a: Any, b: Any) -> bool:
    return bool(torch.equal(a[0], b[0])) and a[1] == b[1]


def _capped_stream(directory: Path, cap: int) -> Any:
    stream = cached_stream(N, str(directory))
    stream.dataset.cache.max_bytes = cap
    return stream


def test_the_stage_must_not_draw_and_is_warned_about_when_it_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class Drawing(_Listed):
        def __getitem__(self, i: int) -> Any:
            return self.items[i] + torch.rand(1)

    ds = cached(Drawing([torch.zeros(1)] * 4), cache=DiskCache(tmp_path), measure=False)
    with caplog.at_level(logging.WARNING, logger="producer.cache_stage"):
        ds[0], ds[1]
    assert sum("drew from torch's generator" in r.getMessage() for r in caplog.records) == 1


def test_the_examples_cached_imagefolder_gives_the_uncached_pipelines_images(
    tmp_path: Path,
) -> None:
    pytest.importorskip("PIL")
    from examples.imagefolder import resized_imagefolder

    root = str(tmp_path / "img")
    args = {"images": 6, "side": 50, "height": 40, "resize": 32, "crop": 24}
    plain = resized_imagefolder(root, **args)
    cache = str(tmp_path / "cache")
    for _ in range(2):  # cold, then warm
        ds = resized_imagefolder(root, **args, cache_dir=cache)
        for i in range(len(plain)):
            seed_globals(77 + i)
            got = ds[i]
            seed_globals(77 + i)
            want = plain[i]
            assert got[0].shape == (3, 24, 24) and got[0].dtype == torch.uint8
            assert torch.equal(got[0], want[0]) and got[1] == want[1]
    # Fewer builds than the cache needs to judge itself: every entry was written.
    assert len(plain) < cache_stage.MIN_SAMPLES
    assert ds.stats["hits"] == len(plain) and ds.stats["misses"] == 0


def _plus_one(batch: dict[str, list[Any]]) -> dict[str, Any]:
    return {"x": torch.tensor(batch["x"]) + 1}


def _plus_two(batch: dict[str, list[Any]]) -> dict[str, Any]:
    return {"x": torch.tensor(batch["x"]) + 2}


def test_a_hugging_face_dataset_is_named_by_its_files_and_its_transform(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    in_memory = datasets.Dataset.from_dict({"x": [[1.0, 2.0], [3.0, 4.0]]})
    with pytest.raises(ConfigError, match=r"in memory.*pass cached\(\.\.\., key=\.\.\.\)"):
        cached(in_memory, cache=DiskCache(tmp_path / "c"))
    in_memory.save_to_disk(str(tmp_path / "hf"))
    fingerprints = []
    for transform in (_plus_one, _plus_two):
        ds = datasets.load_from_disk(str(tmp_path / "hf"))
        ds.set_transform(transform)
        wrapped = cached(ds, cache=DiskCache(tmp_path / "c"), measure=False)
        assert torch.equal(wrapped[1]["x"], ds[1]["x"]) and torch.equal(wrapped[1]["x"], ds[1]["x"])
        assert wrapped.stats["hits"] == 1
        fingerprints.append(wrapped.fingerprint)
    assert fingerprints[0] != fingerprints[1]  # another set_transform, another stage
    keyed = cached(in_memory, cache=DiskCache(tmp_path / "c", key="xs-v1"), measure=False)
    assert keyed[0]["x"] == [1.0, 2.0]
