"""producer.torch served against the real redis-server, by producer processes.

Every batch is compared by its bytes with the batch built in this process by the same
shard plan (what any producer builds for that address), and its indices with what a
real DataLoader yields.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import uuid4

import numpy as np
import pytest
import redis
from waiting import wait_until

torch = pytest.importorskip("torch")

from built_bytes import Batch, as_bytes, built  # noqa: E402
from torch_pipelines import RngDataset, iterable_stream, make_loader, rng_stream  # noqa: E402

from batchq.protocol.admin import delete_queue  # noqa: E402
from batchq.protocol.fields import StatsField  # noqa: E402
from batchq.protocol.keys import QueueKeys  # noqa: E402
from consumer import ServerDataStream  # noqa: E402
from consumer.torch import TorchStream  # noqa: E402

EXAMPLES, BATCH, SEED = 120, 8, 3  # 15 batches an epoch
EPOCHS = 3


def loader_indices(epochs: int) -> list[list[list[int]]]:
    """The indices a real DataLoader yields with rng_stream's settings."""
    loader = torch.utils.data.DataLoader(
        RngDataset(EXAMPLES),
        batch_size=BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(SEED),
    )
    return [[b[0].tolist() for b in loader] for _ in range(epochs)]


def trainer(url: str, queue: str, sources: tuple[str, ...], **kw: Any) -> ServerDataStream:
    kw.setdefault("timeout_s", 60)
    return ServerDataStream(sources, False, url=url, queue=queue, **kw)


def argv_for(serve_argv: Callable[..., list[str]], queue: str, *extra: str, **kw: Any) -> list[str]:
    argv = serve_argv(*extra, **kw)
    argv[argv.index("--queue") + 1] = queue
    return argv


@pytest.fixture
def other_queue(redis_url: str) -> Any:
    """A second queue for a test that compares two runs; its keys go afterwards."""
    name = f"t{uuid4().hex[:12]}"
    yield name
    client = redis.Redis.from_url(redis_url)
    try:
        delete_queue(client, name)
    finally:
        client.close()


def test_three_producers_one_sigkilled_mid_epoch_give_one_producers_bytes_exactly_once(
    redis_url: str,
    queue_name: str,
    other_queue: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    redis_client: Any,
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH, slow_ms=2)  # ~16 ms a batch
    factory = "torch_pipelines:rng_stream"
    sources = ("index", "aug")
    # A run with one producer.
    spawn_proc(argv_for(serve_argv, other_queue, "--hwm", "4", factory=factory), env=env)
    single: list[list[Batch]] = []
    with trainer(redis_url, other_queue, sources) as stream:
        for _ in range(EPOCHS):
            single.append([as_bytes(b) for b in stream.get_epoch_iterator()])
        stream.close(finished=True)
    # The same with three, one of them SIGKILLed in the middle of epoch 1.
    argv = serve_argv("--hwm", "4", "--heartbeat-ttl-s", "1", factory=factory)
    procs = [spawn_proc(argv, env=env) for _ in range(3)]
    keys = QueueKeys(queue_name)
    three: list[list[Batch]] = []
    held = 0
    with trainer(redis_url, queue_name, sources, stall_s=1.0) as stream:
        for e in range(EPOCHS):
            got = []
            for k, batch in enumerate(stream.get_epoch_iterator()):
                got.append(as_bytes(batch))
                if e == 1 and k == 4:
                    wait_until(lambda: redis_client.zcard(keys.producers) == 3, what="3 producers")
                    procs[0].send_signal(signal.SIGKILL)  # no hand-back: its lease is reaped
                    procs[0].wait(timeout=10)
                    # What it held then: its lease list stays until its heartbeat (1 s)
                    # lapses and it is reaped. Whether it held one is the interleaving's.
                    killed = f"-{procs[0].pid}-"
                    ids = [p.decode() for p in redis_client.zrange(keys.producers, 0, -1)]
                    held = sum(redis_client.llen(keys.lease(p)) for p in ids if killed in p)
            three.append(got)
        assert len(stream.producers_seen) >= 2
        stream.close(finished=True)
    redone = redis_client.hget(keys.stats, StatsField.REDONE_SHARDS)
    if held:  # the killed producer's leased shards were built again
        assert int(redone or 0) >= 1
    assert three == single  # byte for byte, in the same order
    assert single == built(rng_stream(EXAMPLES, BATCH, SEED), EPOCHS)
    want = loader_indices(EPOCHS)
    for e in range(EPOCHS):
        indices = [np.frombuffer(b[0], np.int64).tolist() for b in three[e]]
        assert indices == want[e]  # the DataLoader's order
        assert sorted(i for b in indices for i in b) == list(range(EXAMPLES))  # once each
    assert three[0] != three[1]  # augmentations differ from epoch to epoch


# The factory's DataLoader says pin_memory=True; the trainer's TorchStream here is on the CPU.
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")
def test_a_dataloader_factory_is_served_by_batchq_serve(
    redis_url: str,
    queue_name: str,
    spawn_proc: Any,
    serve_argv: Any,
    serve_env: Any,
    tmp_path: Path,
) -> None:
    argv = serve_argv("--hwm", "4", factory="torch_pipelines:make_loader")
    argv[argv.index("--log-level") + 1] = "INFO"
    log = tmp_path / "serve.log"
    with log.open("wb") as err:
        proc = spawn_proc(argv, env=serve_env(examples=60, batch_size=8), stderr=err)
        loader = make_loader()
        loader.num_workers = 0  # the same order, without starting workers here
        want = [[b[0].tolist() for b in loader] for _ in range(2)]
        with TorchStream(trainer(redis_url, queue_name, ("0", "1"))) as ts:
            got = []
            for _ in range(2):
                epoch = list(ts)
                assert all(isinstance(t, torch.Tensor) for b in epoch for t in b)
                assert {b[1].dtype for b in epoch} == {torch.float32}
                got.append([b[0].tolist() for b in epoch])
            ts.close(finished=True)
        assert proc.wait(timeout=30) == 0
    assert got == want  # drop_last: 7 batches of 8 from 60 examples, the loader's order
    text = log.read_text()
    assert "num_workers=2, pin_memory=True, prefetch_factor=4" in text
    assert text.count("ignored, they belong to the trainer's side") == 1


def test_an_iterable_dataset_splits_by_worker_info(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    env = serve_env(examples=50)
    argv = serve_argv("--hwm", "3", factory="torch_pipelines:iterable_stream")
    for _ in range(2):
        spawn_proc(argv, env=env)
    want = built(iterable_stream(), 2)  # 3 shards of 17, 17 and 16 examples
    sources = ("value", "worker", "workers", "noise")
    with trainer(redis_url, queue_name, sources) as stream:
        for e in range(2):
            epoch = list(stream.get_epoch_iterator())
            assert [as_bytes(b) for b in epoch] == want[e]
            values = [int(v) for b in epoch for v in b[0]]
            assert values == list(range(50))  # each example once, shard by shard
            assert {int(w) for b in epoch for w in b[2]} == {3}
            assert [int(w) for b in epoch for w in b[1]] == [v // 17 for v in values]
        stream.close(finished=True)


def test_resume_mid_epoch_from_torchstream_state_dict_is_exact(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH)
    spawn_proc(serve_argv("--hwm", "4", factory="torch_pipelines:rng_stream"), env=env)
    want = [b for epoch in built(rng_stream(EXAMPLES, BATCH, SEED), EPOCHS) for b in epoch]
    sources = ("index", "aug")
    got: list[Batch] = []
    with TorchStream(trainer(redis_url, queue_name, sources), prefetch=3) as ts:
        got += [as_bytes(b) for b in ts]
        it = iter(ts)
        got += [as_bytes(next(it)) for _ in range(6)]
        state = ts.state_dict()  # batches the loop received; the prefetched come again
    with TorchStream(trainer(redis_url, queue_name, sources)) as ts:
        ts.load_state_dict(state)
        while ts.stream.epoch + 1 < EPOCHS:
            got += [as_bytes(b) for b in ts]
        ts.close(finished=True)
    assert got == want


def test_ranks_get_equal_disjoint_shares(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    env = serve_env(examples=EXAMPLES, batch_size=BATCH)
    for _ in range(2):
        spawn_proc(serve_argv("--hwm", "4", factory="torch_pipelines:rng_stream"), env=env)
    epochs = 2
    want = built(rng_stream(EXAMPLES, BATCH, SEED), epochs)
    shares: dict[int, list[list[Batch]]] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with trainer(redis_url, queue_name, ("index", "aug"), rank=r, world_size=2) as s:
                shares[r] = [[as_bytes(b) for b in s.get_epoch_iterator()] for _ in range(epochs)]
                s.close(finished=True)
        except BaseException as e:  # reported by the test's thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not errors, errors
    for e in range(epochs):
        a, b = shares[0][e], shares[1][e]
        assert len(a) == len(b) == 8  # 15 batches: ceil(15 / 2) each, one pad
        assert a == want[e][0::2] and b == [*want[e][1::2], want[e][0]]  # slot s: rank s % 2
        assert not set(a[:8]) & set(b[:7])
