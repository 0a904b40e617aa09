"""The URL forms: one server, a cluster, Sentinel; passwords masked in every message."""

from __future__ import annotations

import pytest
from redis.connection import SSLConnection

from batchq.client.connection import describe_url, make_client, resolve_url
from batchq.client.urls import parse_target
from batchq.errors import ConfigError


def test_a_cluster_url_names_its_seed_nodes_and_credentials() -> None:
    target = parse_target("redis+cluster://bq:p%40ss@h1:7000,h2,[::1]:7002/")
    assert target.kind == "cluster"
    assert target.nodes == (("h1", 7000), ("h2", 6379), ("::1", 7002))
    assert target.options["username"] == "bq" and target.options["password"] == "p@ss"
    assert target.db == 0 and not target.tls
    assert target.where() == "h1:7000,h2:6379,[::1]:7002"


def test_tls_and_redis_py_options_apply_to_every_node() -> None:
    target = parse_target("rediss+cluster://h1:7000/?ssl_ca_certs=%2Fetc%2Fca.crt&socket_timeout=2")
    assert target.tls and target.options["connection_class"] is SSLConnection
    assert target.options["ssl_ca_certs"] == "/etc/ca.crt"
    assert target.options["socket_timeout"] == 2.0


def test_a_sentinel_url_names_the_master_its_database_and_the_sentinels_password() -> None:
    target = parse_target("redis+sentinel://:pw@s1:26380,s2/mymaster/2?sentinel_password=sp")
    assert target.kind == "sentinel"
    assert target.nodes == (("s1", 26380), ("s2", 26379))  # a sentinel's default port
    assert (target.service, target.db) == ("mymaster", 2)
    assert target.options["password"] == "pw" and target.options["db"] == 2
    assert target.sentinel_options == {"password": "sp"}
    assert "sentinel_password" not in target.options


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis+cluster://h:1/3", "database 0"),
        ("redis+cluster://h:x/", "port 'x'"),
        ("redis+cluster://h:70000/", "port '70000'"),
        ("redis+cluster://:secret@/", "without a host"),
        ("redis+sentinel://h:1/", "names the master"),
        ("redis+sentinel://h:1/m/zero", "database 'zero'"),
        ("redis+sentinel://h:1/m/0/extra", "names the master"),
        ("memcached://h:1", "unknown scheme"),
    ],
)
def test_a_bad_url_is_a_config_error_naming_it_and_the_forms(url: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as info:
        resolve_url(url)
    message = str(info.value)
    assert "redis+cluster://host:port" in message and "redis+sentinel://" in message
    assert "secret" not in message


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://user:secret@h:1/0", "redis://user:***@h:1/0"),
        ("redis+cluster://u:secret@h1:1,h2:2/", "redis+cluster://u:***@h1:1,h2:2/"),
        (
            "redis+sentinel://:secret@s1:1/m/0?sentinel_password=also&socket_timeout=1",
            "redis+sentinel://:***@s1:1/m/0?sentinel_password=***&socket_timeout=1",
        ),
        ("rediss+cluster://h:1?password=secret", "rediss+cluster://h:1?password=***"),
    ],
)
def test_every_password_is_masked(url: str, shown: str) -> None:
    assert describe_url(url) == shown


def test_clients_for_a_cluster_and_sentinel_keep_retries_off_and_the_packer() -> None:
    for url in ("redis+cluster://127.0.0.1:1/", "redis+sentinel://127.0.0.1:1/m/0"):
        kwargs = make_client(url, key="bq:{q}:meta").connection_pool.connection_kwargs
        assert kwargs["retry"].get_retries() == 0
        assert type(kwargs["command_packer"]).__name__ == "_PiecesPacker"
