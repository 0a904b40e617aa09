"""``batchq serve`` under faults (issue 11, points 10 and 11): a crashed trainer's run
is abandoned after --orphan-exit-s, modules of the current folder import as with
python -m, and a checkout named batchq in the current folder does not break it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from pipelines import examples_of, numbered

from consumer import ServerDataStream

REPO = Path(__file__).resolve().parents[2]


def epoch(url: str, queue: str, *, finish: bool = True) -> list[list[int]]:
    stream = ServerDataStream(("features", "targets"), url=url, queue=queue, timeout_s=30)
    got = [examples_of(f) for f, _ in stream.get_epoch_iterator()]
    stream.close(finished=finish)
    return got


def reference() -> list[list[int]]:
    return [examples_of(f) for f, _ in numbered(60, 10).get_epoch_iterator()]


def test_producers_of_a_crashed_trainer_exit_after_orphan_exit_s(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any,
    tmp_path: Path,
) -> None:  # fmt: skip
    # Before: a trainer that crashed left `batchq serve` serving for ever.
    log = tmp_path / "serve.log"
    argv = serve_argv("--orphan-exit-s", "1", "--heartbeat-ttl-s", "0.6")
    argv[argv.index("WARNING")] = "INFO"
    with log.open("wb") as out:
        proc = spawn_proc(argv, env=serve_env(examples=60, batch_size=10), stderr=out)
    stream = ServerDataStream(
        ("features", "targets"), url=redis_url, queue=queue_name, claim_ttl_s=0.5
    )
    next(iter(stream.get_epoch_iterator()))
    assert stream._reader is not None
    stream._reader.stop()  # the trainer "crashes": its claim lapses, nobody releases it
    assert proc.wait(timeout=30) == 0
    text = log.read_text()
    assert "orphan-exit-s" in text and "no trainer has claimed" in text


def test_a_live_trainer_keeps_its_producers(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any
) -> None:
    proc = spawn_proc(
        serve_argv("--orphan-exit-s", "1", "--heartbeat-ttl-s", "0.6"),
        env=serve_env(examples=60, batch_size=10),
    )
    with ServerDataStream(("features", "targets"), url=redis_url, queue=queue_name) as stream:
        for _ in range(3):
            list(stream.get_epoch_iterator())
        assert proc.poll() is None  # still serving: the claim is live
        stream.close(finished=True)
    assert proc.wait(timeout=20) == 0


def test_serve_imports_a_module_of_the_current_folder(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_env: Any, tmp_path: Path
) -> None:
    # Before: the `batchq` script could not import mystream.py from its folder.
    script = Path(sys.executable).with_name("batchq")
    if not script.exists():
        pytest.skip(f"no console script at {script}")
    (tmp_path / "mystream.py").write_text(
        "from pipelines import numbered\n\ndef make():\n    return numbered(60, 10)\n"
    )
    argv = [str(script), "serve", "mystream:make", "--url", redis_url, "--queue", queue_name]
    proc = spawn_proc(argv, env=serve_env(), cwd=tmp_path)
    assert epoch(redis_url, queue_name) == reference()
    assert proc.wait(timeout=20) == 0


def test_cli_runs_from_the_folder_above_a_checkout_named_batchq(
    redis_url: str, queue_name: str, spawn_proc: Any, serve_argv: Any, serve_env: Any,
    tmp_path: Path,
) -> None:  # fmt: skip
    # Before: "batchq" became a namespace package over the checkout and the install, and
    # loading the Lua scripts failed: TypeError: MultiplexedPath.joinpath().
    (tmp_path / "batchq").symlink_to(REPO, target_is_directory=True)
    argv = serve_argv(factory="pipelines:numbered")
    proc = spawn_proc(argv, env=serve_env(examples=60, batch_size=10), cwd=tmp_path)
    assert epoch(redis_url, queue_name) == reference()
    assert proc.wait(timeout=20) == 0
