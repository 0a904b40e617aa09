"""The Redis URLs batchq accepts, parsed in one place.

Three kinds of deployment, five schemes (and ``unix://``)::

    redis://[user:password@]host:port/<db>             one server (rediss://: TLS)
    redis+cluster://[user:password@]host:port[,host:port...]/
                                                       a Redis Cluster: any of its nodes
                                                       (rediss+cluster://: TLS)
    redis+sentinel://[user:password@]host:port[,host:port...]/<master-name>[/<db>]
                                                       a master watched by Sentinel: the
                                                       sentinels' addresses
                                                       (rediss+sentinel://: TLS to Redis)

The user and password are Redis' (every node of a cluster, the master and replicas of
a Sentinel deployment); sentinels that require a password of their own get it in the
query (``?sentinel_password=...``, ``sentinel_username=...``). Every other query
option is redis-py's (``ssl_ca_certs``, ``socket_connect_timeout``...) and applies to
every node. A port left out is 6379 (26379 for a sentinel). A cluster has only
database 0.

:func:`parse_target` turns a URL into a :class:`Target`; :func:`describe_url` masks
every password (the query's too) for messages and logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, Literal
from urllib.parse import parse_qsl, quote, urlencode

from redis.connection import parse_url

from batchq.errors import ConfigError

__all__ = [
    "CLUSTER_SCHEMES",
    "SENTINEL_SCHEMES",
    "SERVER_SCHEMES",
    "Kind",
    "Target",
    "describe_url",
    "parse_target",
]

Kind = Literal["server", "cluster", "sentinel"]
SERVER_SCHEMES: Final = ("redis", "rediss", "unix")
CLUSTER_SCHEMES: Final = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES: Final = ("redis+sentinel", "rediss+sentinel")
_DEFAULT_PORT = {"cluster": 6379, "sentinel": 26379}
_SENTINEL_QUERY = ("sentinel_username", "sentinel_password")
_EXPECTED = (
    "expected redis://host:port/<db>, rediss://..., unix:///path, "
    "redis+cluster://host:port[,host:port...]/ (or rediss+cluster://) or "
    "redis+sentinel://host:port[,host:port...]/<master-name>[/<db>] (or rediss+sentinel://)"
)


@dataclass(frozen=True)
class Target:
    """Where a URL says Redis is.

    Attributes:
        url: the URL as given.
        kind: 'server' (one Redis), 'cluster' or 'sentinel'.
        nodes: the cluster's seed nodes or the sentinels, as (host, port); empty for a
            server.
        service: the master's name (Sentinel), else ''.
        db: the database index.
        tls: connections to Redis use TLS.
        options: redis-py's connection arguments for Redis itself (user, password, TLS
            and query options; no host or port), for a cluster or Sentinel.
        sentinel_options: the sentinels' own (``sentinel_username``/``_password``).
    """

    url: str
    kind: Kind
    nodes: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    tls: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    sentinel_options: dict[str, Any] = field(default_factory=dict)

    def where(self) -> str:
        """The nodes or sentinels as 'host:port,...' (no credentials), for messages."""
        return ",".join(f"{_host_text(h)}:{p}" for h, p in self.nodes)


def _bad(url: str, why: str) -> ConfigError:
    return ConfigError(f"Redis URL {describe_url(url)!r} is not valid: {why}; {_EXPECTED}")


def parse_target(url: str) -> Target:
    """Parse a URL of any of the accepted forms (see the module's docstring).

    Raises:
        ConfigError: naming the URL (password masked) and what was expected.
    """
    if not isinstance(url, str) or "://" not in url:
        raise _bad(str(url), "no scheme")
    scheme = url.split("://", 1)[0].lower()
    if scheme in SERVER_SCHEMES:
        options = _redis_py_options(url, url)
        return Target(url, "server", db=int(options.get("db") or 0), tls=scheme == "rediss")
    if scheme not in CLUSTER_SCHEMES + SENTINEL_SCHEMES:
        raise _bad(url, f"unknown scheme {scheme!r}")
    return _many_nodes(url, scheme)


def _many_nodes(url: str, scheme: str) -> Target:
    """The target of a cluster or Sentinel URL."""
    kind: Kind = "cluster" if scheme in CLUSTER_SCHEMES else "sentinel"
    userinfo, hosts, path, query = _parts(url.split("://", 1)[1])
    nodes = tuple(_node(url, item, _DEFAULT_PORT[kind]) for item in hosts.split(","))
    service, db = _path(url, kind, path)
    pairs = parse_qsl(query, keep_blank_values=True)
    tls = scheme.startswith("rediss")
    options = _node_options(url, userinfo, db, tls, pairs)
    if kind == "cluster" and int(options.get("db") or 0) != 0:
        raise _bad(url, f"a cluster has only database 0, not {options['db']}")
    sentinel = {k.removeprefix("sentinel_"): v for k, v in pairs if k in _SENTINEL_QUERY}
    return Target(url, kind, nodes, service, db, tls, options, sentinel)


def _node_options(
    url: str, userinfo: str, db: int, tls: bool, pairs: list[tuple[str, str]]
) -> dict[str, Any]:
    """redis-py's connection arguments every node of a cluster or Sentinel URL shares
    (credentials, TLS, the query's options but the Sentinel's own; no host, port or
    path), read as redis-py reads a one-server URL."""
    node_query = urlencode([(k, v) for k, v in pairs if k not in _SENTINEL_QUERY])
    one = f"{'rediss' if tls else 'redis'}://{userinfo + '@' if userinfo else ''}x:1/{db}"
    options = _redis_py_options(url, f"{one}?{node_query}" if node_query else one)
    for name in ("host", "port", "path"):
        options.pop(name, None)
    return options


def _parts(rest: str) -> tuple[str, str, str, str]:
    """(userinfo, hosts, path, query) of what follows a cluster or Sentinel URL's
    scheme; the path may be left out ('redis+cluster://h:1?x=y')."""
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    if "?" in netloc:
        netloc, _, query = netloc.partition("?")
    userinfo, _, hosts = netloc.rpartition("@")
    return userinfo, hosts, path, query


def _redis_py_options(url: str, one_server_url: str) -> dict[str, Any]:
    """redis-py's connection arguments for a one-server URL; its ValueError named as the
    URL given (``url``, masked) being invalid."""
    try:
        options: dict[str, Any] = parse_url(one_server_url)  # type: ignore[no-untyped-call]
    except ValueError as e:
        raise _bad(url, str(e)) from e
    return options


def _node(url: str, item: str, default_port: int) -> tuple[str, int]:
    """(host, port) of one 'host[:port]' of a cluster or Sentinel URL ('[::1]:p' too)."""
    item = item.strip()
    if item.startswith("["):
        host, _, after = item[1:].partition("]")
        port_text = after.removeprefix(":") if after.startswith(":") else after
    else:
        host, _, port_text = item.partition(":")
    if not host:
        raise _bad(url, f"a node without a host ({item!r})")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise _bad(url, f"port {port_text!r} of {item!r} is not a TCP port (1..65535)")
    return host, int(port_text)


def _path(url: str, kind: Kind, path: str) -> tuple[str, int]:
    """(master name, db) from a URL's path: '' or '0' on a cluster, '<name>[/<db>]' for
    Sentinel."""
    parts = [p for p in path.split("/") if p]
    if kind == "cluster":
        if parts not in ([], ["0"]):
            raise _bad(url, f"a cluster URL's path is '/' (database 0), not '/{path}'")
        return "", 0
    if not parts or len(parts) > 2:
        raise _bad(url, "a Sentinel URL names the master: /<master-name>[/<db>]")
    if len(parts) == 2 and not parts[1].isdigit():
        raise _bad(url, f"database {parts[1]!r} is not a number")
    return parts[0], int(parts[1]) if len(parts) == 2 else 0


def _host_text(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def describe_url(url: str) -> str:
    """The URL with every password masked (the user's, and a sentinel's in the query),
    for messages and logs."""
    if not isinstance(url, str) or "://" not in url:
        return str(url)
    scheme, rest = url.split("://", 1)
    netloc, slash, tail = rest.partition("/")
    query_sep = "?" if "?" in netloc else ""
    if query_sep:  # no path: the query follows the hosts
        netloc, _, query = netloc.partition("?")
        tail, slash = "", ""
    else:
        tail, query_sep, query = tail.partition("?")
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + ":***"
    masked_query = "&".join(
        f"{k}=***" if k.endswith("password") else f"{k}={quote(v, safe='/:')}"
        for k, v in parse_qsl(query, keep_blank_values=True)
    )
    return (
        f"{scheme}://{userinfo}{at}{hosts}{slash}{tail}"
        f"{query_sep if masked_query else ''}{masked_query}"
    )
