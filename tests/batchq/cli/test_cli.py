"""The batchq command: help, status (table and JSON), demo."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any

import pytest

from batchq.cli import LOG_LEVELS, build_parser, main
from batchq.client.urls import CLUSTER_SCHEMES, SENTINEL_SCHEMES, SERVER_SCHEMES
from batchq.monitoring.rows import STATUS_FIELDS, STATUS_SCHEMA_VERSION
from batchq.protocol.keys import QueueKeys
from producer import Producer


def run_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "batchq.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


@pytest.mark.parametrize(
    "command", ["serve", "demo", "status", "reset", "top", "exporter", "report"]
)
def test_every_command_explains_url_in_help(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert "--url" in capsys.readouterr().out


def test_status_reports_depth_hwm_and_producers(
    redis_url: str, queue_name: str, redis_client: Any
) -> None:
    from pipelines import numbered

    keys = QueueKeys(queue_name)
    producer = Producer(numbered(200, 20), redis_url, queue_name, hwm=3)
    thread = threading.Thread(target=producer.serve, daemon=True)
    thread.start()
    try:
        done = run_cli("status", "--url", redis_url, "--queue", queue_name, "--json")
        assert done.returncode == 0, done.stderr
        (row,) = json.loads(done.stdout)
        assert tuple(row) == STATUS_FIELDS  # the documented schema, in order
        assert row["queue"] == queue_name
        assert row["hwm"] == 3 and row["producers_alive"] == 1
        assert 0 <= row["depth"] <= 3
        assert row["trainer"] == "detached"
        table = run_cli("status", "--url", redis_url)
        assert table.returncode == 0
        header, *lines = table.stdout.splitlines()
        assert header.split()[:3] == ["QUEUE", "DEPTH/HWM", "PRODUCERS"]
        assert any(line.startswith(queue_name) for line in lines)
    finally:
        producer.stop()
        thread.join(timeout=10)
    assert redis_client.zcard(keys.producers) == 0


def test_status_of_an_unreachable_server_is_a_clear_error() -> None:
    done = run_cli("status", "--url", "redis://127.0.0.1:1/0")
    assert done.returncode == 2
    assert "connection lost" in done.stderr.lower() or "connect" in done.stderr.lower()
    assert "Traceback" not in done.stderr


def test_demo_runs_end_to_end_on_its_embedded_redis() -> None:
    done = run_cli(
        "--log-level",
        "WARNING",
        "demo",
        "--epochs",
        "2",
        "--examples",
        "200",
        "--batch-size",
        "50",
        "--load-ms",
        "1",
        "--train-ms",
        "2",
        "--producers",
        "2",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    assert "embedded redis-server" in done.stderr  # the progress: on stderr with --json
    assert "epoch 2/2" in done.stderr
    result = json.loads(done.stdout)  # stdout: exactly one JSON document
    assert result["producer_exit_codes"] == [0, 0, 0]
    assert set(result["runs"]) == {"in-process", "served (1 producer)", "served (2 producers)"}
    assert all(r["batches"] == 8 for r in result["runs"].values())
    assert result["floor_s"] > 0


def test_reset_deletes_one_queue_only_after_confirmation(
    redis_url: str, queue_name: str, redis_client: Any
) -> None:
    mine, other = QueueKeys(queue_name), QueueKeys(queue_name + "x")
    redis_client.hset(mine.meta, "run", "r")
    redis_client.rpush(mine.data, b"frame")
    redis_client.hset(other.meta, "run", "r")
    try:
        declined = run_cli("reset", "--url", redis_url, "--queue", queue_name)
        assert declined.returncode == 1 and "--yes" in declined.stderr
        assert redis_client.exists(mine.meta, mine.data) == 2
        done = run_cli("reset", "--url", redis_url, "--queue", queue_name, "--yes")
        assert done.returncode == 0, done.stderr
        assert "deleted 2 keys" in done.stdout
        assert redis_client.exists(mine.meta, mine.data) == 0
        assert redis_client.exists(other.meta) == 1
    finally:
        redis_client.delete(other.meta)


def test_every_option_has_an_environment_variable_and_config_shows_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BATCHQ_URL", "redis://user:secret@db:6380/0")
    monkeypatch.setenv("BATCHQ_HWM", "7")
    monkeypatch.setenv("BATCHQ_HEARTBEAT_TTL_S", "2.5")
    assert main(["config", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by = {(r["command"], r["option"]): r for r in rows}
    assert by[("serve", "--hwm")]["value"] == 7
    assert by[("serve", "--hwm")]["source"] == "environment"
    assert by[("serve", "--heartbeat-ttl-s")]["value"] == 2.5
    assert by[("status", "--url")]["value"] == "redis://user:***@db:6380/0"
    assert "secret" not in json.dumps(rows)
    assert by[("serve", "--workers")]["source"] == "default"
    # Every option of every command has one, named after the option.
    assert all(r["variable"] == "BATCHQ_" + r["option"][2:].replace("-", "_").upper() for r in rows)


def test_a_bad_environment_value_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("BATCHQ_HWM", "ten")
    assert main(["config"]) == 2
    assert "BATCHQ_HWM='ten' is not valid: expected int" in capsys.readouterr().err


def test_status_help_names_the_schema_version_that_status_json_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["status", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert f"(schema version {STATUS_SCHEMA_VERSION})" in text


def test_every_url_help_names_every_scheme_the_parser_accepts() -> None:
    parser = build_parser()
    helps = {
        command: action.help or ""
        for command, sub in parser.commands.items()
        for action in sub.options
        if action.dest == "url"
    }
    assert set(helps) == set(parser.commands) - {"config"}
    for command, text in helps.items():
        for scheme in (*SERVER_SCHEMES, *CLUSTER_SCHEMES, *SENTINEL_SCHEMES):
            assert f" {scheme}://," in text or f" {scheme}:// " in text, (command, scheme)
    assert "embedded redis-server" in helps["demo"]  # its default without --url


def test_an_unknown_log_level_is_an_error_naming_it_and_the_levels(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--log-level", "nonsense", "config"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--log-level: 'nonsense' is not valid: expected one of" in err
    assert all(level in err for level in LOG_LEVELS)
    monkeypatch.setenv("BATCHQ_LOG_LEVEL", "bogus")
    assert main(["config"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "batchq: BATCHQ_LOG_LEVEL='bogus' is not valid: expected one of DEBUG, INFO, "
        "WARNING, ERROR, CRITICAL (in any case)"
    )


def test_config_shows_the_log_level_where_it_came_from(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def log_level(*argv: str) -> dict[str, Any]:
        assert main([*argv, "config", "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        (row,) = [r for r in rows if r["option"] == "--log-level"]
        assert rows[0] == row  # the option of batchq itself, first
        return {k: row[k] for k in ("command", "variable", "value", "source")}

    found = {"command": "batchq", "variable": "BATCHQ_LOG_LEVEL"}
    assert log_level() == {**found, "value": "INFO", "source": "default"}
    monkeypatch.setenv("BATCHQ_LOG_LEVEL", "debug")  # any case
    assert log_level() == {**found, "value": "DEBUG", "source": "environment"}
    assert log_level("--log-level", "Error") == {
        **found,
        "value": "ERROR",
        "source": "command line",
    }
    assert main(["config"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split() == ["batchq", "--log-level", "BATCHQ_LOG_LEVEL", "DEBUG", "environment"]


def test_a_database_index_the_server_lacks_names_the_server_and_the_index(
    redis_url: str,
) -> None:
    # The CLI's calls named no client: the message read "Redis at ? ... refused the
    # connection's settings".
    url = redis_url.rsplit("/", 1)[0] + "/99"
    done = subprocess.run(
        [sys.executable, "-m", "batchq.cli", "status", "--url", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    where = redis_url.split("//", 1)[1].rsplit("/", 1)[0]
    assert f"Redis at {where} (user 'default') refused database index 99" in done.stderr
