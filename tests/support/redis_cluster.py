"""A local Redis Cluster of real redis-servers, for the tests and bench/stripes.py.

``LocalCluster(masters=3)`` starts that many redis-servers of the suite's own binary
(:class:`batchq.host.embedded.EmbeddedRedis`, ``--cluster-enabled yes``) on free
loopback ports, gives each an equal contiguous range of the 16384 slots with
``CLUSTER ADDSLOTS``, a config epoch each (``CLUSTER SET-CONFIG-EPOCH``) and introduces
them with ``CLUSTER MEET`` (what ``redis-cli --cluster create`` does; no redis-cli
needed, and nothing newer than Redis 6.2: no ADDSLOTSRANGE), then waits until every node
sees every slot served. With
``replicas=1`` each master also gets a replica (``CLUSTER REPLICATE``), and
:meth:`LocalCluster.failover` promotes one (``CLUSTER FAILOVER``, or a SIGKILL of its
master and the cluster's own election).
:meth:`LocalCluster.migrate_slot` moves one slot to another master the way a
resharding does (SETSLOT IMPORTING/MIGRATING, MIGRATE of its keys, SETSLOT NODE), in
steps a test can interleave with a running queue.

Redis 6.2's cluster bus listens on the port + 10000 (``cluster-port`` is 7.0), so each
node's port is one whose bus port is free too.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis

from batchq.host.embedded import EmbeddedRedis

__all__ = ["LocalCluster"]

SLOTS = 16384
_BUS_OFFSET = 10000  # Redis 6.2: the cluster bus port is the port + 10000


def _port_with_free_bus(taken: set[int]) -> int:
    """A free loopback port whose bus port (+10000) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + _BUS_OFFSET >= 65536 or port in taken or port + _BUS_OFFSET in taken:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + _BUS_OFFSET))
        except OSError:
            continue
        return port


def _wait(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the local cluster: {what} within {timeout_s:g} s")
        time.sleep(0.02)


class LocalCluster:
    """``masters`` redis-servers forming one cluster on 127.0.0.1.

    Args:
        masters: how many masters (each gets an equal range of slots).
        node_timeout_ms: ``cluster-node-timeout``.
        extra_args: more arguments for every server.
    """

    def __init__(
        self,
        masters: int = 3,
        *,
        replicas: int = 0,
        node_timeout_ms: int = 5000,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.size = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.extra_args = extra_args
        self.nodes: list[EmbeddedRedis] = []
        self._dir = ""

    @property
    def ports(self) -> list[int]:
        """Each node's port: the masters in slot order (node i owns the i-th range at
        start), then their replicas (node masters + i replicates master i)."""
        return [n.port for n in self.nodes]

    @property
    def url(self) -> str:
        """``redis+cluster://`` with every node as a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports) + "/"

    def client(self, i: int) -> redis.Redis:
        """A plain client of node ``i`` (the caller closes it)."""
        return redis.Redis(host="127.0.0.1", port=self.ports[i], socket_timeout=10)

    @contextlib.contextmanager
    def clients(self) -> Iterator[list[redis.Redis]]:
        """A plain client of every node, closed after the block."""
        made = [self.client(i) for i in range(len(self.nodes))]
        try:
            yield made
        finally:
            for c in made:
                c.close()

    def start(self) -> LocalCluster:
        """Start the servers, assign the slots, meet them, wait until the cluster is ok;
        then the replicas, each replicating its master."""
        self._dir = tempfile.mkdtemp(prefix="batchq-cluster-")
        taken: set[int] = set()
        for i in range(self.size * (1 + self.replicas)):
            port = _port_with_free_bus(taken)
            taken.update((port, port + _BUS_OFFSET))
            self.nodes.append(self._node(i, port))
            self.nodes[-1].start()
        with self.clients() as cs:
            for i, c in enumerate(cs[: self.size]):
                first, last = self.slot_range(i)
                c.execute_command("CLUSTER", "ADDSLOTS", *range(first, last + 1))
            # Distinct config epochs, as redis-cli gives them: with all at 0 the nodes
            # resolve the collisions over time, and a slot moved meanwhile (SETSLOT NODE
            # bumps the target's epoch) could be given back by a colliding bump.
            for i, c in enumerate(cs):
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
            for port in self.ports[1:]:
                cs[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)
            _wait(lambda: self._converged(cs), 30.0, "every node sees every slot")
            if self.replicas:
                ids = self.node_ids()
                for i, c in enumerate(cs[self.size :]):
                    c.execute_command("CLUSTER", "REPLICATE", ids[i % self.size])
                _wait(lambda: self._replicated(cs), 30.0, "every replica in sync")
        return self

    def _node(self, i: int, port: int) -> EmbeddedRedis:
        return EmbeddedRedis(
            port=port,
            workdir=f"{self._dir}/node{i}",
            extra_args=[
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                # A replica's full resync at once: Redis 7 syncs diskless and first waits
                # 5 s (repl-diskless-sync-delay) for more replicas to share the transfer.
                "--repl-diskless-sync-delay", "0",
                # CLUSTER SLOTS lists a replica only once its replication offset is known
                # to be non-zero; on an empty master that takes the master's first ping
                # of its replicas (repl-ping-replica-period, 10 s by default).
                "--repl-ping-replica-period", "1",
                *self.extra_args,
            ],
        )  # fmt: skip

    def _replicated(self, cs: list[redis.Redis]) -> bool:
        for c in cs[self.size :]:
            info = c.info("replication")
            if info["role"] != "slave" or info["master_link_status"] != "up":
                return False
        # Every node lists every master's replica (CLUSTER SLOTS: the replicas after it).
        return all(
            all(len(entry) >= 4 for entry in c.execute_command("CLUSTER", "SLOTS")) for c in cs
        )

    def slot_range(self, i: int) -> tuple[int, int]:
        """The first and last slot node ``i`` was given at start."""
        return i * SLOTS // self.size, (i + 1) * SLOTS // self.size - 1

    def _converged(self, cs: list[redis.Redis]) -> bool:
        for c in cs:
            info = c.execute_command("CLUSTER", "INFO")
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text:
                return False
            served = sum(int(r[1]) - int(r[0]) + 1 for r in c.execute_command("CLUSTER", "SLOTS"))
            if served != SLOTS or len(c.execute_command("CLUSTER", "NODES").splitlines()) != len(
                self.nodes
            ):
                return False
        return True

    def node_of_slot(self, slot: int) -> int:
        """The index of the node that owns ``slot`` now (asks node 0)."""
        with self.clients() as cs:
            for entry in cs[0].execute_command("CLUSTER", "SLOTS"):
                if int(entry[0]) <= slot <= int(entry[1]):
                    return self.ports.index(int(entry[2][1]))
        raise LookupError(f"no node serves slot {slot}")

    def node_of(self, key: str) -> int:
        """The index of the node that holds ``key``'s slot now."""
        with self.clients() as cs:
            return self.node_of_slot(int(cs[0].execute_command("CLUSTER", "KEYSLOT", key)))

    def node_ids(self) -> list[str]:
        """Each node's cluster id, in node order."""
        with self.clients() as cs:
            return [
                (lambda v: v.decode() if isinstance(v, bytes) else str(v))(
                    c.execute_command("CLUSTER", "MYID")
                )
                for c in cs
            ]

    def keys_per_node(self, match: str) -> list[int]:
        """How many keys matching ``match`` each node holds."""
        with self.clients() as cs:
            return [sum(1 for _ in c.scan_iter(match=match, count=1000)) for c in cs]

    def migrate_slot(
        self, slot: int, target: int, *, between: Callable[[], Any] | None = None
    ) -> int:
        """Move ``slot`` to node ``target`` as a resharding does; returns keys moved.

        Args:
            slot: the slot.
            target: the node that gets it.
            between: called after the slot is marked IMPORTING/MIGRATING and some keys
                moved, before the rest move and the slot changes owner: the clients
                see ASK and TRYAGAIN meanwhile.
        """
        source = self.node_of_slot(slot)
        if source == target:
            return 0
        ids = self.node_ids()
        moved = 0
        with self.clients() as cs:
            src, dst = cs[source], cs[target]
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
            first = True
            while True:
                keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10)
                if not keys:
                    break
                src.execute_command(
                    "MIGRATE", "127.0.0.1", self.ports[target], "", 0, 10000, "KEYS", *keys
                )
                moved += len(keys)
                if first and between is not None:
                    between()
                first = False
            if first and between is not None:
                between()
            # The target first, then the source, then everyone (as redis-cli does).
            dst.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])
            src.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])
            for i, c in enumerate(cs):
                if i not in (source, target):
                    c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])
        return moved

    def failover(self, master: int, *, kill: bool) -> float:
        """Promote master ``master``'s replica: ``CLUSTER FAILOVER`` on it (coordinated:
        it catches up first), or SIGKILL of the master and the other masters' election
        (``cluster-node-timeout``). Returns the seconds until every live node names the
        replica as the owner of the master's slots; the replica is node ``master`` from
        then on (the old master, if alive, is its replica)."""
        replica = self.size + master
        first = self.slot_range(master)[0] if master < self.size else None
        slot = first if first is not None else 0
        started = time.monotonic()
        if kill:
            self.nodes[master].kill()
        else:
            node = self.client(replica)
            try:
                node.execute_command("CLUSTER", "FAILOVER")
            finally:
                node.close()
        live = [i for i in range(len(self.nodes)) if not (kill and i == master)]

        def promoted() -> bool:
            for i in live:
                node = self.client(i)
                try:
                    for entry in node.execute_command("CLUSTER", "SLOTS"):
                        owns = int(entry[0]) <= slot <= int(entry[1])
                        if owns and int(entry[2][1]) != self.ports[replica]:
                            return False
                finally:
                    node.close()
            return True

        _wait(promoted, 60.0, f"master {master}'s replica promoted")
        # Indices follow the roles: the promoted replica is master ``master`` now.
        self.nodes[master], self.nodes[replica] = self.nodes[replica], self.nodes[master]
        return time.monotonic() - started

    def stop(self) -> None:
        """Stop every server and remove their directories."""
        for node in self.nodes:
            node.stop()
        self.nodes.clear()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
