"""status, dead and top --once on a queue that is not there: a clear error naming the
queues that are, never an empty made-up queue; a queue whose run left only some keys
(its history) is still there."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from batchq.cli import main
from batchq.client.connection import describe_url, make_client
from batchq.monitoring.rows import queue_exists
from batchq.protocol.admin import delete_queue
from batchq.protocol.keys import QueueKeys

COMMANDS = [["status"], ["status", "--json"], ["dead"], ["dead", "--json"], ["top", "--once"]]


@pytest.fixture
def other_queue(queue_url: str, queue_name: str) -> Iterator[str]:
    """Another queue on the server, with a meta hash; its name sorts before the test
    queues' (``t...``), so the error's list (the first 20 names) shows it."""
    name = f"0{queue_name}"
    client = make_client(queue_url, key=QueueKeys(name).meta)
    try:
        client.hset(QueueKeys(name).meta, mapping={"run": "r", "hwm": 4})
        yield name
    finally:
        delete_queue(client, name)
        client.close()


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_a_queue_that_is_not_there_is_an_error_naming_those_that_are(
    command: list[str],
    redis_url: str,
    queue_name: str,
    other_queue: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*command, "--url", redis_url, "--queue", queue_name]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # no empty queue made up
    (line,) = err.splitlines()
    assert line.startswith(f"batchq {command[0]}: no queue {queue_name!r} at ")
    assert describe_url(redis_url) in line
    assert "the queues there: " in line
    assert other_queue in line.split("the queues there: ")[1].split(", ")


def test_reset_makes_a_queue_not_there(
    redis_url: str, queue_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = QueueKeys(queue_name)
    client = make_client(redis_url)
    try:
        client.hset(keys.meta, mapping={"run": "r", "hwm": 4})
        assert main(["status", "--url", redis_url, "--queue", queue_name, "--json"]) == 0
        (row,) = json.loads(capsys.readouterr().out)
        assert row["queue"] == queue_name and row["hwm"] == 4
        assert main(["reset", "--url", redis_url, "--queue", queue_name, "--yes"]) == 0
        capsys.readouterr()
        assert main(["status", "--url", redis_url, "--queue", queue_name]) == 2
        assert f"no queue {queue_name!r}" in capsys.readouterr().err
    finally:
        client.close()


@pytest.mark.parametrize("queue_url", ["redis", "cluster"], indirect=True)
def test_a_queue_with_only_its_history_left_is_there(
    queue_url: str, queue_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its meta lost or deleted, what the run left is still the queue's: status shows it
    # (report plots its history).
    keys = QueueKeys(queue_name)
    client = make_client(queue_url, key=keys.meta)
    try:
        assert not queue_exists(client, queue_name)
        client.lpush(keys.history, json.dumps({"t": 1000.0, "depth": 2, "stall": 0.5}))
        assert queue_exists(client, queue_name)
        for command in COMMANDS:
            assert main([*command, "--url", queue_url, "--queue", queue_name]) == 0, command
        out = capsys.readouterr().out
        assert f"queue {queue_name}: 0 example(s) quarantined" in out
        client.delete(keys.history)
        client.hset(keys.meta, "run", "r")  # the usual case: its meta answers at once
        assert queue_exists(client, queue_name)
    finally:
        client.close()


def test_the_list_of_queues_there_is_cut_at_20(
    redis_url: str, queue_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    names = [f"0{queue_name}-{i:02d}" for i in range(23)]
    client = make_client(redis_url)
    try:
        for name in names:
            client.hset(QueueKeys(name).meta, "run", "r")
        assert main(["dead", "--url", redis_url, "--queue", queue_name]) == 2
        listed = capsys.readouterr().err.split("the queues there: ")[1]
        assert listed.startswith(", ".join(names[:20]) + " (+")
        assert names[20] not in listed
    finally:
        for name in names:
            delete_queue(client, name)
        client.close()
