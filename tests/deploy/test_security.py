"""Nothing that comes out of Redis is ever unpickled or executed.

Anyone who can write to a queue's keys can put anything in its data list. Here a pickle
whose ``__reduce__`` would create a canary file, a msgpack-numpy style object-array map
carrying that pickle, and a well-formed batchq frame declaring an object ('O') dtype over
those bytes go into the data list of a queue that a real producer serves: inline, and by
reference (the frame under the queue's frame prefix, its name in the list), plus a
reference to a key outside the queue. The trainer (``on_bad_frame='skip'``) still gets
exact epochs; each element lands in the dead list with its reason; nothing ran.
"""

from __future__ import annotations

import pickle
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import redis
from pipelines import examples_of, numbered
from waiting import wait_until

from batchq.protocol.keys import QueueKeys
from batchq.wire import codec
from batchq.wire.frame import encode_ref
from batchq.wire.values import PREFIX, align
from consumer import ServerDataStream

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


class Canary:
    """Unpickling this creates ``path``: what a malicious pickle would do, harmlessly."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def pickle_payload(path: Path) -> bytes:
    return pickle.dumps(Canary(path))


def msgpack_numpy_payload(path: Path) -> bytes:
    """An object array the way msgpack-numpy encodes it: its decoder unpickles ``data``."""
    return msgpack.packb(
        {
            b"nd": True,
            b"type": "|O",
            b"kind": b"O",
            b"shape": [1],
            b"data": pickle_payload(path),
        }
    )


def object_dtype_frame(path: Path, run: str) -> bytes:
    """A frame with a valid prefix and header whose first item claims dtype '|O' over
    the pickle's bytes (a decoder that trusted dtypes would build an object array)."""
    good = codec.encode_frame(
        codec.FrameHeader(
            codec.FrameKind.BATCH,
            run=run,
            epoch=0,
            shard=0,
            k=0,
            g=0,
            producer="intruder",
            sources=("features", "targets"),
        ),
        (np.zeros((1, 8), dtype=np.int64), 0),
    )
    hlen = PREFIX.unpack_from(good)[4]
    header = msgpack.unpackb(bytes(good[PREFIX.size : PREFIX.size + hlen]))
    payload = pickle_payload(path)
    count = -(-len(payload) // 8)
    off = 1024  # past any header this small, 64-aligned
    header["items"][0] = {"dtype": "|O", "shape": [count], "off": off, "len": 8 * count}
    packed = msgpack.packb(header)
    assert align(PREFIX.size + len(packed)) <= off
    prefix = PREFIX.pack(
        codec.MAGIC, codec.FORMAT_VERSION, codec.FrameKind.BATCH, bytes(3), len(packed)
    )
    frame = prefix + packed
    return frame + bytes(off - len(frame)) + payload.ljust(8 * count, b"\0")


def test_the_payloads_are_live(tmp_path: Path) -> None:
    # Proof that the payloads below would run if anything unpickled them.
    pickle.loads(pickle_payload(tmp_path / "control"))
    assert (tmp_path / "control").exists()


def test_pickles_and_object_arrays_from_redis_are_dead_frames_and_never_run(
    redis_url: str,
    redis_client: redis.Redis,
    queue_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    spawn_proc: Callable[..., Any],
    serve_argv: Callable[..., list[str]],
    serve_env: Callable[..., dict[str, str]],
) -> None:
    canary = tmp_path / "canary"
    unpickled: list[object] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        unpickled.append(args)
        raise AssertionError("something unpickled data from Redis")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)

    keys = QueueKeys(queue_name)
    producer = spawn_proc(serve_argv("--hwm", "4"), env=serve_env(examples=200, batch_size=20))
    run = wait_until(lambda: redis_client.hget(keys.meta, "run"), 30, "the producer to join")

    inline = {
        "pickle": pickle_payload(canary),
        "msgpack-numpy": msgpack_numpy_payload(canary),
        "object dtype": object_dtype_frame(canary, run.decode()),
    }
    elements = list(inline.values())
    for n, value in enumerate(inline.values()):
        key = f"{keys.frame_prefix}intruder:{n}"
        redis_client.set(key, value)
        elements.append(encode_ref(key))
    elements.append(encode_ref(QueueKeys(queue_name + "-other").meta))
    # The right end is popped first: all of these come before the producer's frames.
    redis_client.rpush(keys.data, *elements)

    local = numbered(200, 20)
    with ServerDataStream(
        ("features", "targets"), url=redis_url, queue=queue_name, timeout_s=30, on_bad_frame="skip"
    ) as stream:
        for _ in range(2):
            served = [examples_of(f) for f, _ in stream.get_epoch_iterator()]
            assert served == [examples_of(f) for f, _ in local.get_epoch_iterator()]
        stream.close(finished=True)
    assert producer.wait(timeout=30) == 0

    records = [msgpack.unpackb(r) for r in redis_client.lrange(keys.dead, 0, -1)]
    reasons = Counter(r["reason"] for r in records)
    assert reasons == {"bad_magic": 4, "bad_dtype": 2, "bad_ref": 1}
    for reason, count in reasons.items():
        assert redis_client.hget(keys.stats, f"dead:{reason}") == str(count).encode()
    assert all(r["detail"] for r in records)  # each says what was wrong
    assert not list(redis_client.scan_iter(match=keys.frame_pattern))  # fetched and gone
    assert unpickled == []
    assert not canary.exists()
