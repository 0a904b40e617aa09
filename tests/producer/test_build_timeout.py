"""``build_timeout_s``: an example whose read never returns, served by producer processes
against the real redis-server (issue 42). The producer that meets it first gives the
attempt up after build_timeout_s and exits; the next attempts are isolated (each example
read first in a forked child, producer/isolation.py), where the child is stopped instead:
after max_attempts the trainer gets ProducerFailed naming the example, instead of
waiting for ever.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from batchq.errors import ProducerFailed
from consumer import ServerDataStream

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "serve_options.py"
HANG = 7  # the example whose read never returns
ATTEMPTS = 2


@pytest.mark.timeout(120)
def test_a_build_that_never_returns_is_producer_failed_naming_the_example(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_env: Any
) -> None:
    env = serve_env(examples=120, batch_size=8, hang=HANG)
    argv = [
        sys.executable, str(SCRIPT), "torch_pipelines:hanging_stream", "--url", redis_url,
        "--queue", queue_name, "--build-timeout-s", "1", "--max-attempts", str(ATTEMPTS),
    ]  # fmt: skip
    errors: list[BaseException] = []

    def train() -> None:
        try:
            with ServerDataStream(("index", "aug"), url=redis_url, queue=queue_name) as stream:
                for _ in stream.get_epoch_iterator():
                    pass
        except BaseException as e:  # the test's thread looks at it
            errors.append(e)

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    # The first attempt: the build is given up after build_timeout_s and the producer
    # stops (the stuck read cannot be interrupted).
    first = spawn_proc(argv, env=env, stderr=subprocess.PIPE)
    assert first.wait(timeout=60) == 3
    assert f"(reading example {HANG})".encode() in first.stderr.read()
    # The next takes the shard handed back first, isolated: its forked child is stopped
    # after build_timeout_s, the producer goes on.
    second = spawn_proc(argv, env=env, stderr=subprocess.DEVNULL)
    trainer.join(timeout=60)
    assert not trainer.is_alive()
    (error,) = errors
    assert isinstance(error, ProducerFailed)
    text = str(error)
    assert f"ExampleKilled: example {HANG} never returned" in text
    assert "build_timeout_s=1.0" in text
    assert second.poll() is None


@pytest.mark.timeout(120)
def test_a_pool_replaces_the_workers_a_stuck_build_stops(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    # `batchq serve --workers 2 --build-timeout-s 1`: the worker that meets the hang
    # gives its attempt up and exits to be replaced; the next attempts are isolated; the
    # pool keeps 2 until the trainer has ProducerFailed naming the example
    # (max_attempts, 3 by default).
    env = serve_env(examples=120, batch_size=8, hang=HANG)
    argv = serve_argv(
        "--workers", "2", "--build-timeout-s", "1", factory="torch_pipelines:hanging_stream"
    )
    pool = spawn_proc([*argv, "--heartbeat-ttl-s", "2"], env=env, stderr=subprocess.PIPE)
    with (
        ServerDataStream(("index", "aug"), url=redis_url, queue=queue_name) as stream,
        pytest.raises(ProducerFailed, match=rf"ExampleKilled: example {HANG} never returned"),
    ):
        for _ in stream.get_epoch_iterator():
            pass
    assert pool.poll() is None  # still serving: its stopped workers were replaced
