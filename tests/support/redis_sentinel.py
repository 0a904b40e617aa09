"""A master, one replica and three sentinels of real redis-servers, for the failover tests.

``LocalSentinel()`` starts two redis-servers of the suite's own binary
(:class:`batchq.host.embedded.EmbeddedRedis`; the second ``--replicaof`` the first) and
three sentinels (``redis-server <conf> --sentinel``, quorum 2), on free loopback ports,
each in its own process group, and waits until every sentinel knows the replica and the
two other sentinels. :meth:`LocalSentinel.failover` forces one failover and waits until
the deployment can take the next one:

* ``kill=False``: ``SENTINEL FAILOVER``. Redis 6.2's Sentinel promotes the replica at
  once but reconfigures the demoted master only at its next look (about 10 s later);
  meanwhile it still takes writes, which its conversion then throws away. The fixture
  plays that reconfiguration itself (``REPLICAOF`` the new master), once no client of
  the old master is left but the sentinels' (bounded): the clients must have moved to
  the new master by themselves, as they would have to in production;
* ``kill=True``: SIGKILL of the master's process group; the sentinels agree it is down
  (``down-after-milliseconds``) and fail over; the old master is started again empty,
  as a replica of the new one (never as an empty master).

Either way the call returns once the old master is a replica in sync with the new one
and every sentinel sees it as a good replica again, with the figures of that failover
(:class:`Failover`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from batchq.host.embedded import EmbeddedRedis, find_redis_server
from batchq.host.procs import spawn, stop_group

__all__ = ["Failover", "LocalSentinel"]

SERVICE = "batchq"


@dataclass(frozen=True)
class Failover:
    """What one failover took.

    Attributes:
        kill: the master was SIGKILLed (else SENTINEL FAILOVER).
        switch_s: from the trigger until every sentinel names the new master.
        drained_s: (SENTINEL FAILOVER) until no client but the sentinels' was active
            on the old master; None where some stayed past the bound, or for a kill.
        ready_s: until the old master is a replica in sync, seen by every sentinel.
    """

    kill: bool
    switch_s: float
    drained_s: float | None
    ready_s: float


def _wait(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(redis.RedisError, OSError, LookupError):
            value = check()
            if value:
                return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"the local Sentinel deployment: {what} within {timeout_s:g} s")
        time.sleep(0.02)


#: Every data node's own arguments: a full resync starts at once. Redis 7 syncs replicas
#: diskless by default and waits ``repl-diskless-sync-delay`` (5 s) for more replicas to
#: share the transfer; with one replica that only delays each failover's resync (of the
#: restarted empty node, of the demoted master) by 5 s.
NODE_ARGS = ("--repl-diskless-sync-delay", "0")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalSentinel:
    """Two redis-servers (a master and its replica) and three sentinels on 127.0.0.1.

    Args:
        down_after_ms: ``sentinel down-after-milliseconds``: how long a master may not
            answer before a sentinel thinks it down.
    """

    def __init__(self, down_after_ms: int = 1000) -> None:
        self.down_after_ms = down_after_ms
        self.nodes: list[EmbeddedRedis] = []
        self.sentinel_ports: list[int] = []
        self._sentinels: list[subprocess.Popen[bytes]] = []
        self._dir = ""

    @property
    def url(self) -> str:
        """``redis+sentinel://`` of the three sentinels, master ``batchq``, database 0."""
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def _node_dir(self, i: int) -> str:
        return os.path.join(self._dir, f"node{i}")

    def start(self) -> LocalSentinel:
        """Start the master, the replica and the sentinels; wait until they all agree."""
        self._dir = tempfile.mkdtemp(prefix="batchq-sentinel-")
        master = EmbeddedRedis(workdir=self._node_dir(0), extra_args=NODE_ARGS)
        master.start()
        self.nodes.append(master)
        replica = EmbeddedRedis(
            workdir=self._node_dir(1),
            extra_args=[*NODE_ARGS, "--replicaof", "127.0.0.1", str(master.port)],
        )
        replica.start()
        self.nodes.append(replica)
        self._wait_synced(1, master.port)
        binary = find_redis_server()
        for i in range(3):
            folder = Path(self._dir) / f"sentinel{i}"
            folder.mkdir()
            port = _free_port()
            conf = folder / "sentinel.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {master.port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
                f"sentinel failover-timeout {SERVICE} 10000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            with open(folder / "out.log", "ab") as out:
                self._sentinels.append(spawn([binary, str(conf), "--sentinel"], stdout=out,
                                             stderr=subprocess.STDOUT))  # fmt: skip
            self.sentinel_ports.append(port)
        _wait(self._settled, 30.0, "every sentinel sees the replica and its peers")
        return self

    def sentinel(self, i: int) -> redis.Redis:
        """A client of sentinel ``i`` (the caller closes it)."""
        return redis.Redis(port=self.sentinel_ports[i], socket_timeout=5, decode_responses=True)

    def node(self, i: int) -> redis.Redis:
        """A plain client of data node ``i`` (the caller closes it)."""
        return redis.Redis(port=self.nodes[i].port, socket_timeout=5)

    def _ask_all(self, fn: Callable[[redis.Redis], Any]) -> list[Any]:
        answers = []
        for i in range(len(self.sentinel_ports)):
            client = self.sentinel(i)
            try:
                answers.append(fn(client))
            finally:
                client.close()
        return answers

    def master_index(self) -> int:
        """Which data node every sentinel names as the master (raises while they differ)."""
        ports = set(
            self._ask_all(
                lambda s: int(s.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)[1])
            )
        )
        if len(ports) != 1:
            raise LookupError(f"the sentinels disagree on the master: {sorted(ports)}")
        return [n.port for n in self.nodes].index(ports.pop())

    def _settled(self) -> bool:
        """Every sentinel: the master agreed, the other node up as its replica, 2 peers."""
        master = self.master_index()
        replica_port = self.nodes[1 - master].port

        def good(s: redis.Redis) -> bool:
            replicas = s.execute_command("SENTINEL", "REPLICAS", SERVICE)
            peers = s.execute_command("SENTINEL", "SENTINELS", SERVICE)
            # Up and a replica to them (no s_down, not disconnected). Their copy of its
            # link status is refreshed every 10 s; the node's own is checked instead
            # (_wait_synced), and a SENTINEL FAILOVER asked before they agree it is a
            # good replica is asked again (NOGOODSLAVE).
            return len(peers) == 2 and any(
                int(r["port"]) == replica_port and r["flags"] == "slave" for r in replicas
            )

        return all(self._ask_all(good))

    def _wait_synced(self, i: int, master_port: int, timeout_s: float = 30.0) -> None:
        """Until data node ``i`` is a replica of ``master_port`` with its link up and has
        what the master had written when it linked (the master goes on writing: its
        offset at any later moment is a target that moves)."""

        def linked() -> bool:
            node = self.node(i)
            try:
                info = node.info("replication")
                return (
                    info["role"] == "slave"
                    and int(info["master_port"]) == master_port
                    and info["master_link_status"] == "up"
                )
            finally:
                node.close()

        _wait(linked, timeout_s, f"node {i} linked to its master")
        master = redis.Redis(port=master_port, socket_timeout=5)
        try:
            target = int(master.info("replication")["master_repl_offset"])
        finally:
            master.close()

        def caught_up() -> bool:
            node = self.node(i)
            try:
                return int(node.info("replication")["slave_repl_offset"]) >= target
            finally:
                node.close()

        _wait(caught_up, timeout_s, f"node {i} in sync with its master")

    def _wait_pair_synced(self, timeout_s: float = 60.0) -> None:
        """Until the node the sentinels name the master has the other as an up-to-date
        replica. Which node that is is read at every look: on a loaded machine the
        sentinels may fail over once more by themselves (a master silent past
        down_after_ms), even while the replica catches up, and the pair then settles the
        other way round; the target offset is read again for each new pair."""
        target: dict[tuple[int, int], int] = {}  # (master, replica) -> offset to reach

        def synced() -> bool:
            master = self.master_index()
            node = self.node(1 - master)
            try:
                info = node.info("replication")
            finally:
                node.close()
            if not (
                info["role"] == "slave"
                and int(info["master_port"]) == self.nodes[master].port
                and info["master_link_status"] == "up"
            ):
                return False
            pair = (master, 1 - master)
            if pair not in target:  # what the master had written when the pair linked
                target.clear()
                head = self.node(master)
                try:
                    target[pair] = int(head.info("replication")["master_repl_offset"])
                finally:
                    head.close()
            return int(info["slave_repl_offset"]) >= target[pair]

        _wait(synced, timeout_s, "the master's replica linked and in sync with it")

    def _clients_left(self, i: int) -> int:
        """Clients of data node ``i`` that sent a command within the last second, but
        the sentinels' and this one (an idle connection writes nothing; its next
        command finds the node a replica and goes to the master)."""
        node = self.node(i)
        try:
            own = int(node.execute_command("CLIENT", "ID"))
            return sum(
                1
                for c in node.client_list(_type="normal")
                if int(c["id"]) != own
                and not str(c.get("name", "")).startswith("sentinel-")
                and int(c.get("idle", 0)) < 1
            )
        finally:
            node.close()

    def failover(self, *, kill: bool, drain_s: float = 10.0) -> Failover:
        """Force one failover (see the module's docstring) and wait until the next can be.

        Args:
            kill: SIGKILL the master (else SENTINEL FAILOVER).
            drain_s: (SENTINEL FAILOVER) how long the old master's clients get to leave
                it before it is made a replica.
        """
        # The sentinels agree at the end of every failover (_settled), but on a loaded
        # machine they may start one of their own later (a master silent past
        # down_after_ms): wait until they agree again before forcing the next. (A
        # 1-tuple: master index 0 is falsy, and _wait returns the first truthy value.)
        (old,) = _wait(lambda: (self.master_index(),), 60.0, "every sentinel names one master")
        new = 1 - old
        started = time.monotonic()
        if kill:
            self.nodes[old].kill()
        else:
            _wait(self._ask_failover, 30.0, "a sentinel accepted SENTINEL FAILOVER")
        _wait(lambda: self.master_index() == new, 30.0, "every sentinel names the new master")
        switch_s = time.monotonic() - started
        drained_s: float | None = None
        if kill:
            restarted = EmbeddedRedis(
                port=self.nodes[old].port, workdir=self._node_dir(old),
                extra_args=[*NODE_ARGS, "--replicaof", "127.0.0.1", str(self.nodes[new].port)],
            )  # fmt: skip
            restarted.start()
            self.nodes[old] = restarted
        else:
            with contextlib.suppress(TimeoutError):
                _wait(
                    lambda: self._clients_left(old) == 0, drain_s, "the old master's clients left"
                )
                drained_s = time.monotonic() - started
            node = self.node(old)
            try:
                node.execute_command("REPLICAOF", "127.0.0.1", self.nodes[new].port)
            finally:
                node.close()
        self._wait_pair_synced()
        _wait(self._settled, 60.0, "every sentinel sees the old master as a good replica")
        return Failover(kill, switch_s, drained_s, time.monotonic() - started)

    def _ask_failover(self) -> bool:
        """SENTINEL FAILOVER to a sentinel; False while it answers INPROG or NOGOODSLAVE."""
        client = self.sentinel(0)
        try:
            client.execute_command("SENTINEL", "FAILOVER", SERVICE)
            return True
        except redis.ResponseError as e:
            if "INPROG" in str(e) or "NOGOODSLAVE" in str(e):
                return False
            raise
        finally:
            client.close()

    def stop(self) -> None:
        """Stop the sentinels and the servers; remove their directories."""
        for proc in self._sentinels:
            stop_group(proc, timeout_s=5.0)
        self._sentinels.clear()
        for node in self.nodes:
            node.stop()
        self.nodes.clear()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""

    def __enter__(self) -> LocalSentinel:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
