"""The plan of an epoch, its shards, and a stream restricted to one shard.

The requests of epoch e are a pure function of (pipeline, seed, e): every producer
computes the same plan, so any shard can be built (and built again) anywhere.

An epoch's requests (the root DataStream's iteration scheme's requests, in order) are
cut into S shards of ``requests_per_shard`` consecutive requests. For a map-style chain
(a DataStream, and transformers that turn each child batch into one batch, like the
tutorial's ``Bottleneck``), building shard s yields exactly the batches the in-process
stream yields for those requests, in the same order; plan order is the in-process order.

Chains that aggregate across requests (Batch, Filter, Cache, Unpack, Merge, or a stream
without an iteration scheme) cannot be cut between arbitrary requests; until the
pipeline learns to say where it can be cut, such an epoch is one shard (S = 1), which is
correct, only less parallel.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from batchq.errors import ConfigError

__all__ = ["ShardPlan", "find_root", "iter_chain"]

# Transformers that consume several child items per item they yield, or buffer them.
_AGGREGATING = frozenset({"Batch", "Filter", "Cache", "Unpack", "Merge"})
# How many epochs' plans go into the fingerprint: enough to tell seeds apart.
_FINGERPRINT_EPOCHS = 2


def iter_chain(stream: Any) -> Iterator[Any]:
    """Yield the stream and every stream below it (through ``data_stream(s)``)."""
    stack = [stream]
    while stack:
        node = stack.pop()
        yield node
        children = getattr(node, "data_streams", None)
        if children:
            stack.extend(reversed(list(children)))
        elif getattr(node, "data_stream", None) is not None:
            stack.append(node.data_stream)


def find_root(stream: Any) -> Any:
    """The DataStream at the bottom of a (single-child) transformer chain."""
    node = stream
    while getattr(node, "data_stream", None) is not None:
        node = node.data_stream
    return node


class _FixedRequests:
    """An iteration scheme that yields a fixed list of requests, once."""

    def __init__(self, requests: Sequence[Any]) -> None:
        self.requests = list(requests)

    def get_request_iterator(self, epoch: int | None = None) -> Iterator[Any]:
        return iter(self.requests)


def _jsonable(request: Any) -> Any:
    if isinstance(request, slice):
        return ["slice", request.start, request.stop, request.step]
    if isinstance(request, np.ndarray):
        return request.tolist()
    if isinstance(request, (list, tuple)):
        return [_jsonable(r) for r in request]
    if isinstance(request, np.integer):
        return int(request)
    return request


class ShardPlan:
    """How a stream's epochs are cut into shards, and how to build one shard.

    Args:
        stream: the stream to serve (a DataStream or a transformer chain over one).
        requests_per_shard: how many consecutive requests make a shard.

    Raises:
        ConfigError: requests_per_shard is not a positive integer, or the scheme gives
            epochs of different lengths (S must be the same for every epoch).
    """

    def __init__(self, stream: Any, requests_per_shard: int = 1) -> None:
        if not isinstance(requests_per_shard, int) or requests_per_shard < 1:
            raise ConfigError(
                f"requests_per_shard {requests_per_shard!r} is not valid: expected an integer >= 1"
            )
        self.stream = stream
        self.root = find_root(stream)
        self.scheme = getattr(self.root, "iteration_scheme", None)
        chain = list(iter_chain(stream))
        aggregating = [type(n).__name__ for n in chain if type(n).__name__ in _AGGREGATING]
        self.shardable = self.scheme is not None and not aggregating and len(chain) >= 1
        self._plans: dict[int, list[Any]] = {}
        if self.shardable:
            n0 = len(self.requests(0))
            n1 = len(self.requests(1))
            if n0 != n1:
                raise ConfigError(
                    f"the iteration scheme gives {n0} requests in epoch 0 and {n1} in epoch "
                    "1: expected the same number every epoch"
                )
            self.requests_per_shard = requests_per_shard
            self.shards = max(1, math.ceil(n0 / requests_per_shard))
            self.epoch_batches: int | None = n0
        else:
            self.requests_per_shard = 0
            self.shards = 1
            self.epoch_batches = None
        self.fingerprint = self._fingerprint(chain)

    def requests(self, epoch: int) -> list[Any]:
        """The requests of ``epoch``, in plan order (cached for the last few epochs)."""
        if self.scheme is None:
            return []
        plan = self._plans.get(epoch)
        if plan is None:
            plan = list(self.scheme.get_request_iterator(epoch=epoch))
            if len(self._plans) >= 4:
                self._plans.pop(min(self._plans))
            self._plans[epoch] = plan
        return plan

    def shard_requests(self, epoch: int, shard: int) -> list[Any]:
        """The requests of shard ``shard`` of ``epoch``."""
        rps = self.requests_per_shard
        return self.requests(epoch)[shard * rps : (shard + 1) * rps]

    def _fingerprint(self, chain: list[Any]) -> str:
        # Sources, shard count, the chain's classes and the first epochs' plans: another
        # seed, dataset size or pipeline gives another fingerprint.
        desc = {
            "sources": list(getattr(self.stream, "sources", ()) or ()),
            "produces_examples": bool(getattr(self.stream, "produces_examples", False)),
            "shards": self.shards,
            "requests_per_shard": self.requests_per_shard,
            "chain": [type(n).__qualname__ for n in chain],
            "plans": [_jsonable(self.requests(e)) for e in range(_FINGERPRINT_EPOCHS)],
        }
        blob = json.dumps(desc, sort_keys=True, default=repr).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    def shard_seed(self, epoch: int, shard: int) -> int:
        """The seed random transformers get for (epoch, shard): same shard, same batches."""
        digest = hashlib.sha256(f"{self.fingerprint}:{epoch}:{shard}".encode()).digest()
        return int.from_bytes(digest[:4], "little")

    def iter_shard(self, epoch: int, shard: int) -> Iterator[tuple[Any, ...]]:
        """Yield the batches of shard ``shard`` of ``epoch``, as tuples in source order."""
        seed = self.shard_seed(epoch, shard)
        for node in iter_chain(self.stream):
            reseed = getattr(node, "reseed", None)
            if callable(reseed):
                reseed(seed)
        if not self.shardable:
            yield from self._iter_whole_epoch(epoch)
            return
        with self._restricted(self.shard_requests(epoch, shard)):
            iterator = self.stream.get_epoch_iterator()
        yield from iterator

    def iter_shard_marked(self, epoch: int, shard: int) -> Iterator[tuple[Any, bool]]:
        """Yield (batch, is_last) for the batches of a shard.

        A map-style shard has one batch per request, so its last batch is known without
        asking the pipeline for one more (which could cost a whole loading step, e.g. a
        transformer that sleeps before it finds its child exhausted). Other chains are
        read one batch ahead.
        """
        batches = self.iter_shard(epoch, shard)
        if self.shardable:
            expected = len(self.shard_requests(epoch, shard))
            for k, batch in enumerate(batches):
                yield batch, k == expected - 1
                if k == expected - 1:
                    return
            return
        it = iter(batches)
        try:
            prev = next(it)
        except StopIteration:
            return
        for item in it:
            yield prev, False
            prev = item
        yield prev, True

    def _iter_whole_epoch(self, epoch: int) -> Iterator[tuple[Any, ...]]:
        if self.scheme is None:
            yield from self.stream.get_epoch_iterator()
            return
        with self._restricted(self.requests(epoch)):
            iterator = self.stream.get_epoch_iterator()
        yield from iterator

    @contextlib.contextmanager
    def _restricted(self, requests: Sequence[Any]) -> Iterator[None]:
        # The root DataStream reads its scheme when an epoch iterator is made: swap in
        # the shard's requests for that moment only.
        saved = self.root.iteration_scheme
        self.root.iteration_scheme = _FixedRequests(requests)
        try:
            yield
        finally:
            self.root.iteration_scheme = saved
