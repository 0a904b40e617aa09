"""The plan of an epoch, its shards, and a stream restricted to one shard.

The requests of epoch e are a pure function of (pipeline, seed, e): every producer
computes the same plan, so any shard can be built (and built again) anywhere.

An epoch's requests (the root DataStream's iteration scheme's requests, in order) are
cut into S shards of ``requests_per_shard`` consecutive requests. The default is the
smallest run of requests at which the chain can be cut exactly (see
:mod:`producer.serving.alignment`): one request for a map-style chain (like the tutorial's), k
example requests for ``Batch(ConstantScheme(k))`` over an example scheme, and so on.
Built shard by shard, an epoch yields exactly the batches the in-process stream yields,
in the same order: plan order is the in-process order.

A chain that cannot be cut exactly (a Batch over a Filter, a Merge, a stream without an
iteration scheme) is served as one shard per epoch, unless ``requests_per_shard`` is
given: then batches near shard boundaries may be grouped differently than in-process
(every example still comes exactly once).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from batchq.errors import ConfigError
from producer.randomness import component_seed
from producer.serving.alignment import Alignment, analyse

__all__ = ["Around", "ShardPlan", "find_root", "iter_chain"]

log = logging.getLogger(__name__)

# How many epochs' plans go into the fingerprint: enough to tell seeds apart.
_FINGERPRINT_EPOCHS = 2


Around = Callable[[int], contextlib.AbstractContextManager[Any]]
_END = object()  # the pipeline has no more batches


class _Puller:
    """Pulls batch k from a shard's iterator inside ``around(k)`` (if given)."""

    def __init__(self, batches: Iterator[Any], around: Around | None) -> None:
        self.batches = batches
        self.around = around

    def __call__(self, k: int) -> Any:
        if self.around is None:
            return next(self.batches, _END)
        with self.around(k):
            return next(self.batches, _END)


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


def _check_quarantine_at_root(stream: Any, root: Any) -> None:
    """Quarantine lives on the chain's root: that is where the run's records, the plan's
    fingerprint and isolation find it (a stream under a Merge is no root).

    Raises:
        ConfigError: a stream other than the root quarantines, naming it.
    """
    for node in iter_chain(stream):
        errors = getattr(node, "sample_errors", None)
        if node is not root and getattr(errors, "mode", None) == "quarantine":
            raise ConfigError(
                f"on_sample_error='quarantine' is set on a {type(node).__name__} below "
                f"{type(root).__name__}: expected it on the root of a single chain (a "
                "DataStream under transformers, not a branch of a Merge); quarantine a "
                "Merge's branches by serving each as a pipeline of its own"
            )


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
        requests_per_shard: how many consecutive requests make a shard; None picks the
            smallest exact cut (see the module docstring).

    Attributes:
        shards: S, shards per epoch.
        requests_per_shard: requests per shard (the last one may have fewer).
        exact: shard by shard equals in-process, batch for batch.
        map_only: each request yields exactly one batch.
        epoch_batches: batches per epoch, when the chain lets it be computed.
        shard_batches: batches per full shard, when computable.
        fingerprint: a hash of what must be equal for producers to share a run.

    Raises:
        ConfigError: requests_per_shard is not a positive integer or not a multiple of
            the chain's cut unit, or the scheme gives epochs of different lengths.
    """

    def __init__(self, stream: Any, requests_per_shard: int | None = None) -> None:
        if requests_per_shard is not None and (
            not isinstance(requests_per_shard, int) or requests_per_shard < 1
        ):
            raise ConfigError(
                f"requests_per_shard {requests_per_shard!r} is not valid: expected an integer >= 1"
            )
        self.stream = stream
        self.root = find_root(stream)
        _check_quarantine_at_root(stream, self.root)
        self.scheme = getattr(self.root, "iteration_scheme", None)
        self._plans: dict[int, list[Any]] = {}
        self.map_only = False
        self.exact = True
        self.epoch_batches: int | None = None
        self.shard_batches: int | None = None
        n0 = len(self.requests(0))
        if self.scheme is not None and n0 != len(self.requests(1)):
            raise ConfigError(
                f"the iteration scheme gives {n0} requests in epoch 0 and "
                f"{len(self.requests(1))} in epoch 1: expected the same number every epoch"
            )
        self.requests_per_shard = self._cut(requests_per_shard, n0)
        self.shards = (
            max(1, math.ceil(n0 / self.requests_per_shard)) if self.scheme is not None else 1
        )
        self.fingerprint = self._fingerprint(list(iter_chain(stream)))

    def _cut(self, requests_per_shard: int | None, n0: int) -> int:
        """Requests per shard: the chain's cut unit (or the multiple of it asked for);
        as asked where no cut is exact (warned: not exact); else one shard per epoch."""
        alignment = analyse(self.stream, self.requests(0)) if self.scheme is not None else None
        if alignment is not None and alignment.unit is not None:
            return self._aligned(alignment.unit, alignment, requests_per_shard)
        if alignment is None or requests_per_shard is None:
            return max(n0, 1)  # one shard per epoch
        log.warning(
            "this pipeline cannot be cut exactly (%s): with requests_per_shard=%d, "
            "batches at shard boundaries may be grouped differently than in-process",
            alignment.reason,
            requests_per_shard,
        )
        self.exact = False
        return requests_per_shard

    def _aligned(self, unit: int, alignment: Alignment, requests_per_shard: int | None) -> int:
        """Requests per shard of a chain that can be cut after every ``unit`` requests;
        the chain's figures follow from its ``alignment``."""
        rps = requests_per_shard or unit
        if rps % unit:
            raise ConfigError(
                f"requests_per_shard {rps} is not valid for this pipeline: expected a "
                f"multiple of {unit} (the fewest requests it can be cut after exactly)"
            )
        self.map_only = alignment.map_only
        self.epoch_batches = alignment.epoch_batches
        if alignment.batches_per_unit is not None:
            self.shard_batches = alignment.batches_per_unit * (rps // unit)
        return rps

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
        # A stream may add what its plans do not show (producer.torch: the dataset's
        # size, batch size, seed); absent, the fingerprint is what it always was.
        extra = getattr(self.stream, "plan_fingerprint", None)
        if extra is not None:
            desc["stream"] = extra
        blob = json.dumps(desc, sort_keys=True, default=repr).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    def shard_seed(self, epoch: int, shard: int) -> int:
        """The seed of (epoch, shard): same shard, same batches.

        Each random component is reseeded with
        ``component_seed(shard_seed, its position in iter_chain)``.
        """
        digest = hashlib.sha256(f"{self.fingerprint}:{epoch}:{shard}".encode()).digest()
        return int.from_bytes(digest[:4], "little")

    def iter_shard(self, epoch: int, shard: int) -> Iterator[tuple[Any, ...]]:
        """Yield the batches of shard ``shard`` of ``epoch``, as tuples in source order."""
        seed = self.shard_seed(epoch, shard)
        # Each component gets its own seed (its position in the chain mixed in): two
        # random transformers never share a stream, whatever rng they were given.
        for position, node in enumerate(iter_chain(self.stream)):
            # A node that needs the shard's address (a DatasetStream's quarantine draws
            # substitutes per epoch) is told it first.
            begin = getattr(node, "begin_shard", None)
            if callable(begin):
                begin(epoch, shard)
            reseed = getattr(node, "reseed", None)
            if callable(reseed):
                reseed(component_seed(seed, position))
        if self.scheme is None:
            yield from self.stream.get_epoch_iterator()
            return
        with self._restricted(self.shard_requests(epoch, shard)):
            iterator = self.stream.get_epoch_iterator()
        yield from iterator

    def iter_shard_marked(
        self, epoch: int, shard: int, around: Around | None = None
    ) -> Iterator[tuple[Any, bool]]:
        """Yield (batch, is_last) for the batches of a shard.

        A map-style shard has one batch per request, so its last batch is known without
        asking the pipeline for one more (which could cost a whole loading step, e.g. a
        transformer that sleeps before it finds its child exhausted). Other chains are
        read one batch ahead.

        Args:
            around: ``around(k)`` is the context in which batch k is pulled from the
                pipeline (the params in effect at its index,
                :class:`producer.control.ShardParams`): a chain read one
                batch ahead still builds each batch under its own.
        """
        pull = _Puller(self.iter_shard(epoch, shard), around)
        if self.map_only:
            expected = len(self.shard_requests(epoch, shard))
            k = 0
            while (batch := pull(k)) is not _END:
                yield batch, k == expected - 1
                if k == expected - 1:
                    return
                k += 1
            return
        prev = pull(0)
        if prev is _END:
            return
        k = 1
        while (item := pull(k)) is not _END:
            yield prev, False
            prev = item
            k += 1
        yield prev, True

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
