"""A single trainer that detaches (``close()`` without finishing) gives back what it
popped and did not yield; one resumed from the state saved right before takes the run
over as it is (issue 40: a restarted trainer's first batch without a rebuild), and any
other state resumes as before, in a new run. Producers are real processes."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from frame_args import encode_with
from pipelines import examples_of, numbered
from shm_pair import shm_pair

from batchq.protocol.fields import StatsField
from batchq.protocol.keys import QueueKeys
from batchq.wire.codec import FrameHeader, FrameKind, decode_frame, encode_frame
from consumer import ServerDataStream
from consumer import detach as detach_module
from consumer.checkpoint import position_digest
from consumer.detach import detach
from consumer.reader.buffer import Buffer
from consumer.reader.ledger import Ledger

EXAMPLES, BATCH = 240, 10  # 24 batches (shards) per epoch
PAD_BYTES = 300_000  # frames big enough to travel by shared memory where it is on
HWM = 4


def reference(epochs: int) -> list[tuple[int, list[int]]]:
    stream = numbered(EXAMPLES, BATCH)
    return [(e, examples_of(f)) for e in range(epochs) for f, _ in stream.get_epoch_iterator()]


@pytest.fixture
def producers(spawn_proc: Any, serve_argv: Any, serve_env: Any) -> Any:
    def start(n: int, transport: str) -> None:
        env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=1, pad_bytes=PAD_BYTES)
        env["BATCHQ_TRANSPORT"] = transport
        for _ in range(n):
            spawn_proc(serve_argv("--hwm", str(HWM), "--heartbeat-ttl-s", "5"), env=env)

    return start


def stream_of(url: str, queue: str) -> ServerDataStream:
    return ServerDataStream(
        ("features", "targets", "pad"), url=url, queue=queue, hwm=HWM, timeout_s=30
    )


def read(stream: ServerDataStream, epochs: int, first: int = 0) -> list[tuple[int, list[int]]]:
    """The batches of ``epochs`` epochs (``first``: batches of the first one to take
    only, then stop there)."""
    got = []
    for e in range(epochs):
        it = stream.get_epoch_iterator()
        for i, (features, *_) in enumerate(it):
            got.append((stream.epoch, examples_of(features)))
            if first and e == epochs - 1 and i + 1 == first:
                break
    return got


def meta(client: redis.Redis, queue: str, field: str) -> str | None:
    raw = client.hget(QueueKeys(queue).meta, field)
    return None if raw is None else raw.decode()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["auto", "redis"])
def test_a_trainer_resumed_where_one_detached_reads_on_in_its_run(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    producers: Any,
    monkeypatch: pytest.MonkeyPatch,
    transport: str,
) -> None:
    monkeypatch.setenv("BATCHQ_TRANSPORT", transport)  # the trainer's side reads it too
    producers(2, transport)
    first = stream_of(redis_url, queue_name)
    got = read(first, 2, first=9)  # epoch 0, then 9 batches of epoch 1
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint file holds it
    first.close()
    run = state["run"]
    marked = meta(redis_client, queue_name, "detached")
    assert marked is not None and marked.startswith(f"{run}:")
    second = stream_of(redis_url, queue_name)
    second.load_state_dict(state)
    it = second.get_epoch_iterator()
    got.append((second.epoch, examples_of(next(it)[0])))
    # Taken over as it is: the same run, nothing rebuilt, the mark gone.
    assert meta(redis_client, queue_name, "run") == run
    assert meta(redis_client, queue_name, "detached") is None
    got += [(second.epoch, examples_of(f)) for f, *_ in it]
    got += read(second, 1)
    assert second.stats["dropped_ahead"] == 0
    second.close(finished=True)
    assert got == reference(3)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("way", ["plain", "pinned", "device", "device_broke_out"])
def test_a_torch_stream_saved_and_closed_is_taken_over_by_the_next(
    redis_url: str, redis_client: redis.Redis, queue_name: str, producers: Any, way: str
) -> None:
    """The torch adapter's loop: its state, then close(). Pinned: the reader thread
    copies each batch into the pinned pool (what ``pin_memory=True`` does where an
    accelerator is; a plain allocator stands in), and the held batches still go back (a
    device run once logged "cannot encode a value of type torch.Tensor" here and started
    a new run). Device: pinned, and up to 4 batches on their way to the device (torch's
    CPU stand-ins for streams and events), saved and closed inside the loop or after it
    broke out: the batches prefetched go back first."""
    torch = pytest.importorskip("torch")
    from waiting import wait_until

    from consumer.torch import TorchStream
    from consumer.torch_memory import DeviceMover, PinnedPool

    producers(2, "auto")
    got = []
    first = TorchStream(stream_of(redis_url, queue_name), as_dict=True, prefetch=4)
    if way != "plain":
        first.pool = PinnedPool(alloc=lambda n: torch.empty(n, dtype=torch.uint8))
        first.stream.configure_frames(hook=first._pin, hook_keeps_values=True)
    if way.startswith("device"):
        first.mover = DeviceMover(torch.device("cpu"), backend=torch.cpu)
    state = None
    for i, batch in enumerate(first):
        got.append((0, examples_of(batch["features"].numpy())))
        if i == 9 and way.startswith("device"):  # more at hand: the next step prefetches
            wait_until(lambda: len(first.stream._buffer.held_frames() or []) >= 2, 15.0)
        if i == 10:
            if way == "device":  # inside the loop: its generator holds what it prefetched
                state = json.loads(json.dumps(first.state_dict()))
                first.close()
            break
    if state is None:
        state = json.loads(json.dumps(first.state_dict()))
        first.close()
    assert sum(state["consumed"].values()) == 11
    second = TorchStream(stream_of(redis_url, queue_name), as_dict=True)
    second.load_state_dict(state)
    epoch = iter(second)
    got.append((0, examples_of(next(epoch)["features"].numpy())))
    assert meta(redis_client, queue_name, "run") == state["run"]  # taken over as it is
    got += [(0, examples_of(b["features"].numpy())) for b in epoch]
    # Nothing missing from the list taken over (a gap would be rebuilt: exact, but a
    # shard handed back, as where the prefetched batches were not given back).
    stats = QueueKeys(queue_name).stats
    assert int(redis_client.hget(stats, StatsField.REDONE_SHARDS) or 0) == 0
    got += [(1, examples_of(b["features"].numpy())) for b in second]
    second.close(finished=True)
    assert got == reference(2)


@pytest.mark.timeout(120)
def test_a_state_before_the_detach_resumes_in_a_new_run(
    redis_url: str, redis_client: redis.Redis, queue_name: str, producers: Any
) -> None:
    producers(2, "redis")
    first = stream_of(redis_url, queue_name)
    it = first.get_epoch_iterator()
    got = [(0, examples_of(next(it)[0])) for _ in range(5)]
    state = json.loads(json.dumps(first.state_dict()))
    for _ in range(3):  # past the state
        next(it)
    first.close()
    marked = meta(redis_client, queue_name, "detached")
    assert marked is not None  # the position after the state: another digest
    second = stream_of(redis_url, queue_name)
    second.load_state_dict(state)
    it = second.get_epoch_iterator()
    got.append((second.epoch, examples_of(next(it)[0])))
    assert meta(redis_client, queue_name, "run") != state["run"]  # rebuilt in a new run
    got += [(second.epoch, examples_of(f)) for f, *_ in it]
    got += read(second, 1)
    second.close(finished=True)
    assert got == reference(2)


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:.*is cast to the declared:UserWarning")  # the cast's own
@pytest.mark.parametrize("change", ["hook", "cast", "subset"])
def test_nothing_is_given_back_where_the_reader_changed_frames_or_at_the_end(
    redis_url: str, redis_client: redis.Redis, queue_name: str, producers: Any, change: str
) -> None:
    producers(1, "redis")
    sources = ("features", "targets") if change == "subset" else ("features", "targets", "pad")
    changed = ServerDataStream(sources, url=redis_url, queue=queue_name, hwm=HWM, timeout_s=30)
    if change == "hook":
        changed.configure_frames(hook=lambda frame: frame)  # may change what it gives back
    if change == "cast":
        changed.configure_frames(dtypes={"features": "int32"})
    got = read(changed, 1, first=4)
    state = json.loads(json.dumps(changed.state_dict()))
    changed.close()
    assert meta(redis_client, queue_name, "detached") is None
    again = stream_of(redis_url, queue_name)
    again.load_state_dict(state)
    got += read(again, 1)
    again.close(finished=True)
    assert got == reference(1)
    assert meta(redis_client, queue_name, "finished") == "1"
    assert meta(redis_client, queue_name, "detached") is None


class _Session:
    """What detach reads of a claimed single trainer's session."""

    claimed, world, grouped, what = True, 1, False, "queue q"
    incarnation, token = "inc", "tok"

    def __init__(self, queue: str, run: str) -> None:
        self.keys = QueueKeys(queue)
        self.run = run

    def position(self) -> tuple[str, None]:
        return self.run, None


@pytest.fixture
def claimed(redis_client: redis.Redis, queue_name: str) -> Any:
    """The session of a trainer holding the claim of run r2 (what detach.lua checks)."""
    keys = QueueKeys(queue_name)
    redis_client.set(keys.incarnation, "inc")
    redis_client.hset(keys.meta, mapping={"run": "r2", "claim": "tok"})
    return _Session(queue_name, "r2")


def _held(run: str) -> Buffer:
    buffer = Buffer(Ledger(4))
    for shard in (1, 0):
        header = FrameHeader(FrameKind.BATCH, run, 0, shard, 0, "p", ("x",), last=True, count=1)
        raw = bytes(encode_frame(header, (np.arange(3) + shard,)))
        assert buffer.put([(decode_frame(raw), raw)], 0) == []
    return buffer


def test_the_frames_held_go_back_in_order_and_frames_of_another_run_never(
    redis_client: redis.Redis, claimed: Any
) -> None:
    session, keys = claimed, claimed.keys
    # Received before Redis lost the queue (run r1), held when the run is r2: the new
    # run's ledger counts them as had, so given back they would be dropped and lost.
    assert detach(session, redis_client, _held("r1"), state={}, host=None, exact=True) == 0
    assert redis_client.llen(keys.data) == 0 and redis_client.hget(keys.meta, "detached") is None
    assert detach(session, redis_client, _held("r2"), state={}, host=None, exact=False) == 0
    assert detach(session, redis_client, _held("r2"), state={}, host="h", exact=True) == 2
    popped = [decode_frame(redis_client.rpop(keys.data)) for _ in range(2)]
    assert [(f.shard, f.data[0].tolist()) for f in popped] == [(0, [0, 1, 2]), (1, [1, 2, 3])]
    assert redis_client.hget(keys.meta, "detached") == f"r2:{position_digest({}, 'h')}".encode()
    assert redis_client.hget(keys.stats, "given_back") == b"2"


def test_a_trainer_that_holds_no_frame_still_marks_its_run(
    redis_client: redis.Redis, claimed: Any
) -> None:
    session, keys = claimed, claimed.keys
    # Its reader had popped nothing past what the loop had when it closed.
    assert detach(session, redis_client, Buffer(Ledger(4)), state={}, host=None, exact=True) == 0
    assert redis_client.hget(keys.meta, "detached") == f"r2:{position_digest({}, None)}".encode()
    assert redis_client.llen(keys.data) == 0


def test_frames_go_back_a_chunk_a_call_the_next_one_last(
    redis_client: redis.Redis, claimed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    session, keys = claimed, claimed.keys
    monkeypatch.setattr(detach_module, "CHUNK_FRAMES", 1)  # one call per frame
    assert detach(session, redis_client, _held("r2"), state={}, host=None, exact=True) == 2
    popped = [decode_frame(redis_client.rpop(keys.data)).shard for _ in range(2)]
    assert popped == [0, 1] and redis_client.hget(keys.meta, "detached") is not None


def _shm_held(tmp_path: Path, fake_redis: Any) -> tuple[Buffer, Any, Any]:
    """A buffer holding one batch of run r2 resolved from a producer's segment: (the
    buffer, the trainer's shared memory, the producer's frame sent)."""
    producer, trainer = shm_pair(tmp_path, fake_redis, 2)
    sent = encode_with(
        producer.encode, FrameKind.BATCH, run="r2", epoch=0, shard=0, k=0, producer="p",
        sources=("x",), data=(np.arange(100, dtype=np.float32),), last=True, count=1,
    )  # fmt: skip
    buffer = Buffer(Ledger(4))
    assert buffer.put([(decode_frame(trainer.resolve(sent.element)), sent.element)], 0) == []
    return buffer, trainer, sent


def test_a_batch_in_shared_memory_goes_back_as_its_descriptor_held_for_the_next(
    redis_client: redis.Redis, claimed: Any, tmp_path: Path, fake_redis: Any
) -> None:
    buffer, trainer, sent = _shm_held(tmp_path, fake_redis)
    got = detach(claimed, redis_client, buffer, state={}, host="h", exact=True, shm=trainer)
    assert got == 1 and redis_client.rpop(claimed.keys.data) == bytes(sent.element)
    del buffer
    gc.collect()
    assert not sent.segment.is_free()  # the trainer that pops the descriptor releases it


def test_a_lost_reply_keeps_the_batches_held_and_a_refusal_releases_them(
    redis_client: redis.Redis,
    claimed: Any,
    tmp_path: Path,
    fake_redis: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = detach_module.trainer_scripts.detach

    def lost(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)  # the script ran: the descriptor listed, the run marked
        raise redis.ConnectionError("the reply was lost")

    monkeypatch.setattr(detach_module.trainer_scripts, "detach", lost)
    buffer, trainer, sent = _shm_held(tmp_path, fake_redis)
    assert detach(claimed, redis_client, buffer, state={}, host="h", exact=True, shm=trainer) == 0
    assert redis_client.rpop(claimed.keys.data) == bytes(sent.element)
    del buffer
    gc.collect()
    assert not sent.segment.is_free()  # never released under a listed descriptor
    monkeypatch.setattr(detach_module.trainer_scripts, "detach", real)
    redis_client.hset(claimed.keys.meta, "claim", "another")  # the claim lost: refused
    (tmp_path / "again").mkdir()
    buffer, trainer, sent = _shm_held(tmp_path / "again", fake_redis)
    assert detach(claimed, redis_client, buffer, state={}, host="h", exact=True, shm=trainer) == 0
    assert redis_client.llen(claimed.keys.data) == 0
    del buffer
    gc.collect()
    assert sent.segment.is_free()  # not given back: released as any
