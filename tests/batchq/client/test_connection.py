"""Where to connect (first match wins) and the tuned clients."""

from __future__ import annotations

import pytest
from redis.connection import PythonRespSerializer

from batchq.client.connection import DEFAULT_URL, Pieces, describe_url, make_client, resolve_url
from batchq.errors import ConfigError


def test_explicit_url_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHQ_URL", "redis://env:1/0")
    assert resolve_url("redis://u:2/0", host="h", port=3) == "redis://u:2/0"


def test_host_port_beat_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHQ_URL", "redis://env:1/0")
    assert resolve_url(None, host="h", port=3) == "redis://h:3/0"
    assert resolve_url(None, port=3) == "redis://localhost:3/0"


def test_environment_then_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHQ_URL", "rediss://env:1/0")
    assert resolve_url() == "rediss://env:1/0"
    monkeypatch.delenv("BATCHQ_URL")
    assert resolve_url() == DEFAULT_URL


@pytest.mark.parametrize("url", ["http://x:1", "localhost:7000"])
def test_bad_scheme_is_refused(url: str) -> None:
    with pytest.raises(ConfigError, match="expected redis://"):
        resolve_url(url)


def test_bad_port_is_refused() -> None:
    with pytest.raises(ConfigError, match="port 70000"):
        resolve_url(port=70000)


def test_password_is_masked() -> None:
    assert describe_url("redis://user:secret@h:1/0") == "redis://user:***@h:1/0"


def test_client_uses_the_copy_free_packer_and_no_retries() -> None:
    client = make_client("redis://127.0.0.1:1/0")
    kwargs = client.connection_pool.connection_kwargs
    assert isinstance(kwargs["command_packer"], PythonRespSerializer)
    assert kwargs["retry"].get_retries() == 0
    assert kwargs["socket_timeout"] > 1.0


def test_pieces_travel_as_one_value(redis_url: str, queue_name: str) -> None:
    client = make_client(redis_url)
    key = f"bq:{{{queue_name}}}:frame:p:1"
    big = memoryview(bytes(range(256)) * 40)  # above the packer's buffer cutoff
    value = Pieces([b"head", big, b"", b"tail"], 4 + len(big) + 4)
    pipe = client.pipeline(transaction=False)
    pipe.set(key, value)
    pipe.strlen(key)
    pipe.execute_command("EVAL", "return ARGV[1]", 0, value)
    _, size, echoed = pipe.execute()
    assert size == len(value) and echoed == bytes(value)
    assert client.get(key) == bytes(value)
    client.close()


def test_backoff_doubles_up_to_its_cap_and_stops_at_the_deadline() -> None:
    from batchq.client.connection import BACKOFF_FIRST_S, BACKOFF_MAX_S, Backoff

    waited: list[float] = []
    backoff = Backoff(3.0, wait=waited.append)  # a fake wait: the clock does not move
    for _ in range(8):
        assert backoff.pause()
    assert waited[:3] == [BACKOFF_FIRST_S, 2 * BACKOFF_FIRST_S, 4 * BACKOFF_FIRST_S]
    assert max(waited) == BACKOFF_MAX_S
    assert Backoff(0.0, wait=waited.append).pause() is False  # past the deadline: no pause
