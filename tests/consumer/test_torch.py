"""The PyTorch adapter on the CPU wheel, against the real redis-server.

CUDA-only checks are at the end, skipped (with the reason) on machines without CUDA;
the device path is otherwise driven through torch's CPU stand-ins (``torch.cpu``'s
Stream and Event) and a plain allocator for the pinned pool.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from pipelines import FEATURES, examples_of, numbered

torch = pytest.importorskip("torch")

from batchq.errors import ConfigError  # noqa: E402
from consumer import ServerDataStream  # noqa: E402
from consumer.torch import DataLoaderWorkersError, TorchStream  # noqa: E402
from consumer.torch_memory import DeviceMover, PinnedPool  # noqa: E402

EXAMPLES, BATCH = 120, 20  # 6 batches per epoch
PER_EPOCH = EXAMPLES // BATCH

no_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (this machine has the CPU wheel or no GPU)"
)


def stream_of(url: str, queue: str, **kw: Any) -> ServerDataStream:
    kw.setdefault("timeout_s", 20)
    return ServerDataStream(("features", "targets"), False, url=url, queue=queue, **kw)


def reference(epochs: int) -> list[list[int]]:
    local = numbered(EXAMPLES, BATCH)
    return [examples_of(f) for _ in range(epochs) for f, _ in local.get_epoch_iterator()]


@pytest.fixture(params=["inline", "by_reference"])
def served(request: Any, producer_thread: Callable[..., Any]) -> str:
    # A 20 x 8 int64 batch is 1.3 KB: below 1 KiB it travels by reference.
    options = {"inline_max_bytes": 1024} if request.param == "by_reference" else {}
    producer_thread(numbered(EXAMPLES, BATCH), **options)
    return str(request.param)


def test_tensors_are_writable_without_a_warning(
    redis_url: str, queue_name: str, served: str
) -> None:
    with TorchStream(stream_of(redis_url, queue_name)) as ts, warnings.catch_warnings():
        warnings.simplefilter("error")
        batches = list(ts.get_epoch_iterator())
        for features, targets in batches:
            assert isinstance(features, torch.Tensor)
            assert features.dtype == torch.int64 and features.shape == (BATCH, FEATURES)
            features.add_(1)  # in place, no warning
            targets.mul_(2)
    assert len(batches) == PER_EPOCH


def test_by_reference_tensors_share_the_frames_own_buffer(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    producer_thread(numbered(EXAMPLES, BATCH), inline_max_bytes=1024)
    with TorchStream(stream_of(redis_url, queue_name)) as ts:
        features, targets = next(iter(ts))
        # Zero-copy: both sources live in one received frame, a few hundred bytes apart.
        gap = abs(targets.data_ptr() - features.data_ptr())
        assert gap < 4096
        assert features.numpy().base is not None


def test_in_place_changes_never_show_in_another_batch_or_epoch(
    redis_url: str, queue_name: str, served: str
) -> None:
    expected = reference(3)
    got: list[list[int]] = []
    kept: list[Any] = []
    with TorchStream(stream_of(redis_url, queue_name)) as ts:
        for _ in range(3):
            for features, targets in ts:
                got.append(examples_of(features.numpy()))
                assert examples_of(features.numpy()) == targets.tolist()
                kept.append((features.clone(), features))
                features.fill_(-1)  # the trainer scribbles over its batch
                targets.fill_(-1)
    assert got == expected
    for _, live in kept:  # every batch still holds what this loop wrote, nothing else
        assert bool((live == -1).all())
    assert len({t.data_ptr() for _, t in kept}) == len(kept)  # no buffer reused


def test_dict_batches_and_torch_dtypes(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    producer_thread(numbered(EXAMPLES, BATCH))
    stream = stream_of(redis_url, queue_name)
    ts = TorchStream(stream, as_dict=True, dtypes={"features": torch.float32})
    with ts, pytest.warns(UserWarning, match="cast"):
        batch = next(iter(ts))
    assert list(batch) == ["features", "targets"]
    assert batch["features"].dtype == torch.float32
    assert batch["targets"].dtype == torch.int64


def test_bfloat16_has_no_numpy_cast() -> None:
    with pytest.raises(ConfigError, match="bfloat16"):
        TorchStream(ServerDataStream(("x",), False), dtypes={"x": torch.bfloat16})


def test_dataloader_with_no_workers_serves_epochs(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    producer_thread(numbered(EXAMPLES, BATCH))
    with TorchStream(stream_of(redis_url, queue_name)) as ts:
        loader = torch.utils.data.DataLoader(ts, batch_size=None, num_workers=0)
        assert len(loader) == PER_EPOCH
        got = [examples_of(f.numpy()) for _ in range(2) for f, _ in loader]
    assert got == reference(2)


@pytest.mark.parametrize("workers", [1, 2])
def test_dataloader_with_workers_is_refused_before_any_worker_starts(workers: int) -> None:
    ts = TorchStream(ServerDataStream(("features",), False))
    loader = torch.utils.data.DataLoader(ts, batch_size=None, num_workers=workers)
    with pytest.raises(DataLoaderWorkersError, match=f"num_workers={workers}") as info:
        for _ in loader:
            pass
    assert "num_workers=0" in str(info.value)
    assert isinstance(info.value, ValueError)
    assert multiprocessing.active_children() == []
    with pytest.raises(DataLoaderWorkersError):  # every time, not only the first
        iter(loader)


def test_stateful_dataloader_with_workers_is_refused_too() -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    ts = TorchStream(ServerDataStream(("features",), False))
    loader = stateful.StatefulDataLoader(ts, batch_size=None, num_workers=2)
    with pytest.raises(DataLoaderWorkersError):
        iter(loader)
    assert multiprocessing.active_children() == []


def test_isinstance_still_answers_normally() -> None:
    ts = TorchStream(ServerDataStream(("features",), False))
    assert isinstance(ts, torch.utils.data.IterableDataset)
    assert ts.__class__ is TorchStream


def test_pin_memory_without_an_accelerator_warns_once_and_delivers(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator: batches are pinned")
    producer_thread(numbered(EXAMPLES, BATCH))
    ts = TorchStream(stream_of(redis_url, queue_name), pin_memory=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ts:
            got = [examples_of(f.numpy()) for _ in range(2) for f, _ in ts]
    assert got == reference(2)
    pinned = [w for w in caught if "pin_memory" in str(w.message)]
    assert len(pinned) == 1
    assert "no accelerator" in str(pinned[0].message)


def test_a_device_that_is_not_there_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ConfigError, match="cuda:0"):
        TorchStream(ServerDataStream(("x",), False), device="cuda:0")


def test_wrapping_a_started_stream_is_refused(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    producer_thread(numbered(EXAMPLES, BATCH))
    with stream_of(redis_url, queue_name) as stream:
        next(iter(stream.get_epoch_iterator()))
        with pytest.raises(ConfigError, match="before its first epoch"):
            TorchStream(stream)


def test_state_round_trips_through_stateful_dataloader(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    producer_thread(numbered(EXAMPLES, BATCH))
    expected = reference(3)
    got: list[list[int]] = []
    ts = TorchStream(stream_of(redis_url, queue_name))
    loader = stateful.StatefulDataLoader(ts, batch_size=None)
    got += [examples_of(f.numpy()) for f, _ in loader]  # epoch 0
    it = iter(loader)
    got += [examples_of(next(it)[0].numpy()) for _ in range(4)]  # 4 of epoch 1
    saved = json.loads(json.dumps(loader.state_dict()))  # a checkpoint goes through JSON
    ts.close()

    ts2 = TorchStream(stream_of(redis_url, queue_name))
    loader2 = stateful.StatefulDataLoader(ts2, batch_size=None)
    loader2.load_state_dict(saved)
    got += [examples_of(f.numpy()) for f, _ in loader2]  # the rest of epoch 1
    got += [examples_of(f.numpy()) for f, _ in loader2]  # epoch 2
    ts2.close()
    assert got == expected


def test_prefetched_batches_are_not_counted_as_consumed(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    # The device path on torch's CPU stand-ins: side stream, events, prefetch depth 4.
    producer_thread(numbered(EXAMPLES, BATCH))
    expected = reference(2)
    ts = TorchStream(stream_of(redis_url, queue_name), prefetch=4)
    ts.mover = DeviceMover(torch.device("cpu"), backend=torch.cpu)
    it = iter(ts)
    got = [examples_of(next(it)[0].numpy()) for _ in range(2)]
    state = ts.state_dict()
    assert sum(state["consumed"].values()) == 2
    rest = list(it)  # the epoch's end, prefetched to the last batch
    assert sum(ts.state_dict()["consumed"].values()) == 0  # the whole epoch: next one
    assert ts.state_dict()["epoch"] == 1
    assert ts.mover.in_flight <= 1
    ts.close()
    assert got + [examples_of(f.numpy()) for f, _ in rest] == expected[:PER_EPOCH]

    ts2 = TorchStream(stream_of(redis_url, queue_name))
    ts2.load_state_dict(state)
    again = [examples_of(f.numpy()) for f, _ in ts2]
    ts2.close()
    assert again == expected[2:PER_EPOCH]


def test_a_loop_that_breaks_out_then_saves_does_not_count_the_prefetched_batches(
    redis_url: str,
    queue_name: str,
    producer_thread: Callable[..., Any],
) -> None:
    # The habit `for batch in ts: ...; if step == n: break`, then a checkpoint: the
    # generator is closed by then, with batches prefetched and never yielded (the state
    # once counted them, and a resume skipped them).
    from waiting import wait_until

    producer_thread(numbered(EXAMPLES, BATCH))
    expected = reference(2)
    ts = TorchStream(stream_of(redis_url, queue_name, hwm=4), prefetch=4)
    ts.mover = DeviceMover(torch.device("cpu"), backend=torch.cpu)
    got = []
    for i, (features, _) in enumerate(ts):
        got.append(examples_of(features.numpy()))
        if i == 0:  # two more batches at hand: the next step prefetches
            wait_until(lambda: len(ts.stream._buffer.held_frames() or []) >= 2, 15.0)
        if i == 1:
            assert sum(ts._held.values()) >= 1  # prefetched, not yielded
            break
    state = json.loads(json.dumps(ts.state_dict()))
    assert sum(state["consumed"].values()) == 2
    ts.close()
    ts2 = TorchStream(stream_of(redis_url, queue_name))
    ts2.load_state_dict(state)
    got += [examples_of(f.numpy()) for f, _ in ts2]
    ts2.close(finished=True)
    assert got == expected[:PER_EPOCH]


@pytest.mark.parametrize("device", [False, True])
@pytest.mark.parametrize("told", [False, True], ids=["plain", "accelerate"])
def test_a_loop_that_goes_on_after_close_gets_stream_stopped_not_batches_given_back(
    redis_url: str,
    queue_name: str,
    producer_thread: Callable[..., Any],
    device: bool,
    told: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # close() inside the loop gives back what the stream (and the device prefetch) held:
    # the loop's next step must not yield one of those too. Where accelerate is imported
    # the stream looks a batch ahead (it tells Accelerate which batch ends the epoch).
    from batchq.errors import StreamStopped

    if told:
        pytest.importorskip("accelerate.state")
    else:
        monkeypatch.delitem(sys.modules, "accelerate.state", raising=False)
    producer_thread(numbered(EXAMPLES, BATCH))
    ts = TorchStream(stream_of(redis_url, queue_name), prefetch=4)
    if device:
        ts.mover = DeviceMover(torch.device("cpu"), backend=torch.cpu)
    got = []
    with pytest.raises(StreamStopped, match="closed during its epoch"):
        for i, (features, _) in enumerate(ts):
            got.append(examples_of(features.numpy()))
            if i == 1:
                ts.close()
    assert got == reference(1)[:2]


def test_pinned_pool_reuses_a_buffer_only_once_nothing_references_it() -> None:
    pool = PinnedPool(alloc=lambda n: torch.empty(n, dtype=torch.uint8), max_buffers=2)
    a = pool.copy_in(np.arange(16, dtype=np.float32))
    view = a[4:8]
    del a
    b = pool.copy_in(np.ones(16, dtype=np.float32))  # a's memory is still seen by view
    assert pool.allocated == 2 and pool.reused == 0
    assert view.tolist() == [4.0, 5.0, 6.0, 7.0]
    del view
    c = pool.copy_in(np.full(8, 7, dtype=np.float32))  # fits the freed buffer
    assert pool.reused == 1 and pool.allocated == 2
    assert b.tolist() == [1.0] * 16 and c.tolist() == [7.0] * 8
    d = pool.copy_in(np.zeros(4, dtype=np.int16))  # pool full, all in use: its own buffer
    assert pool.allocated == 2 and len(pool) == 2
    assert d.dtype == torch.int16 and d.tolist() == [0, 0, 0, 0]
    assert pool.copy_in("text") == "text"  # values torch cannot hold pass through


def test_device_mover_on_cpu_stand_ins_orders_and_retires() -> None:
    mover = DeviceMover(torch.device("cpu"), backend=torch.cpu)
    host = (torch.arange(6), "label")
    moved, event = mover.issue(host)
    assert event is not None and mover.in_flight == 1
    mover.hand_over(moved, event)
    assert moved[0].tolist() == list(range(6)) and moved[1] == "label"
    assert mover.in_flight == 0  # the stand-in's event completes at once


def test_device_mover_without_a_stream_api_copies_synchronously() -> None:
    mover = DeviceMover(torch.device("cpu"), backend=None)
    mover.backend, mover.side = None, None
    moved, event = mover.issue((torch.ones(2),))
    assert event is None and moved[0].tolist() == [1.0, 1.0]


@no_cuda
def test_cuda_prefetch_delivers_on_the_device(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    producer_thread(numbered(EXAMPLES, BATCH), inline_max_bytes=1024)
    with TorchStream(stream_of(redis_url, queue_name), device="cuda:0", prefetch=3) as ts:
        assert ts.pool is not None
        got = []
        for features, targets in ts:
            assert features.is_cuda and targets.is_cuda
            # Work on the consumer's stream right away: the copy must be waited for.
            got.append(examples_of((features * 1).cpu().numpy()))
        assert ts.pool.allocated >= 1
    assert got == reference(1)


@no_cuda
def test_cuda_pin_memory_gives_pinned_cpu_tensors(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    producer_thread(numbered(EXAMPLES, BATCH), inline_max_bytes=1024)
    with TorchStream(stream_of(redis_url, queue_name), pin_memory=True) as ts:
        batches = list(ts)
        assert all(f.is_pinned() for f, _ in batches)
        assert [examples_of(f.numpy()) for f, _ in batches] == reference(1)


def test_the_example_trains_checkpoints_and_resumes(
    redis_url: str,
    queue_name: str,
    producer_thread: Callable[..., Any],
    tmp_path: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from examples import train_torch

    producer_thread(train_torch.make_stream(seed=3, examples=640, batch_size=64))
    ckpt = str(tmp_path / "ckpt.pt")
    common = ["--url", redis_url, "--queue", queue_name, "--device", "cpu"]
    with pytest.warns(UserWarning, match="cast"):
        assert train_torch.main([*common, "--epochs", "1", "--checkpoint", ckpt]) == 0
    saved = torch.load(ckpt)
    assert saved["data"]["epoch"] == 1 and set(saved) == {"model", "opt", "data"}
    with pytest.warns(UserWarning, match="cast"):  # float64 from the producers
        code = train_torch.main([*common, "--epochs", "3", "--checkpoint", ckpt, "--finish"])
    assert code == 0
    out = capsys.readouterr().out
    assert "resumed at epoch 1" in out
    accuracies = [float(line.split()[-1]) for line in out.splitlines() if "accuracy" in line]
    assert len(accuracies) == 3  # epoch 0, then epochs 1 and 2 after the resume
    assert accuracies[-1] > 0.5  # the patterns are learnable: it really trains
    assert torch.load(ckpt)["data"]["epoch"] == 3


def test_reader_side_pinning_reuses_the_pool_and_spares_held_batches(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    # The pinned path with a plain allocator standing in for pinned memory.
    producer_thread(numbered(EXAMPLES, BATCH), inline_max_bytes=1024)
    ts = TorchStream(stream_of(redis_url, queue_name, hwm=2))
    ts.pool = PinnedPool(alloc=lambda n: torch.empty(n, dtype=torch.uint8), max_buffers=16)
    ts.stream._prep.hooks.append(ts._pin)
    expected = reference(3)
    with ts:
        epochs = [[(f, t) for f, t in ts] for _ in range(3)]
        held = epochs[0][0]  # kept while two more epochs go through the pool
        got = [examples_of(f.numpy()) for epoch in epochs for f, _ in epoch]
    assert got == expected
    assert examples_of(held[0].numpy()) == held[1].tolist() == expected[0]
    assert ts.pool.reused == 0  # every batch of the three epochs is still referenced
    del epochs, held
    with TorchStream(stream_of(redis_url, queue_name + "-2")) as other:
        assert other.pool is None  # pin_memory defaults to False on the CPU


def test_pinning_hook_reuses_buffers_once_batches_are_dropped() -> None:
    pool = PinnedPool(alloc=lambda n: torch.empty(n, dtype=torch.uint8), max_buffers=4)
    ts = TorchStream(ServerDataStream(("x",), False))
    ts.pool = pool
    from batchq.wire import codec

    def frame(value: int) -> Any:
        header = codec.FrameHeader(
            codec.FrameKind.BATCH, run="r", epoch=0, shard=value, k=0, producer="p", sources=["x"]
        )
        raw = codec.encode_frame(header, [np.full((4, 4), value, dtype=np.float32)])
        return codec.decode_frame(bytes(raw))

    kept = ts._pin(frame(1)).data[0]
    for value in range(2, 12):  # dropped at once: the same buffer again and again
        assert ts._pin(frame(value)).data[0].tolist() == [[float(value)] * 4] * 4
    assert kept.tolist() == [[1.0] * 4] * 4
    assert pool.allocated == 2 and pool.reused == 9


def test_a_failing_shard_raises_after_the_batches_before_it_with_prefetch(
    redis_url: str, queue_name: str, producer_thread: Callable[..., Any]
) -> None:
    from pipelines import FailOnExample

    from batchq.errors import ProducerFailed

    producer_thread(FailOnExample(numbered(EXAMPLES, BATCH, shuffled=False), bad=70))
    ts = TorchStream(stream_of(redis_url, queue_name), prefetch=6)
    ts.mover = DeviceMover(torch.device("cpu"), backend=torch.cpu)
    got = []
    with ts, pytest.raises(ProducerFailed):
        for features, _ in ts:
            got.append(examples_of(features.numpy()))
    assert got == [list(range(i, i + BATCH)) for i in range(0, 60, BATCH)]


def test_asking_again_soon_after_looks_at_the_known_loaders_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A heap scan costs in proportion to the heap: a loader's construction and iteration
    # ask several times in a row, and only the first of them scans.
    from types import SimpleNamespace

    from consumer import torch_frameworks as adapter

    scans: list[int] = []
    real = adapter.gc.get_referrers

    def counting(*objs: Any) -> list[Any]:
        scans.append(1)
        return real(*objs)

    monkeypatch.setattr(adapter, "gc", SimpleNamespace(get_referrers=counting))
    ts = TorchStream(ServerDataStream(("features",), False))
    loader = torch.utils.data.DataLoader(ts, batch_size=None, num_workers=0)
    for _ in range(5):
        assert isinstance(ts, torch.utils.data.IterableDataset)
    assert len(scans) == 1
    assert loader.num_workers == 0
