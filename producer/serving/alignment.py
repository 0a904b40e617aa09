"""Where a pipeline can be cut: the shard alignment of a transformer chain.

A shard is a run of consecutive requests of the root stream's scheme. Cutting an epoch
between two requests is exact (the shards' batches, concatenated, are the in-process
epoch's batches) only at points where no transformer holds items across the cut. This
module walks the chain from the root up and works that out:

* one-to-one transformers (Mapping, Cast, Padding, the tutorial's Bottleneck, any
  user transformer that yields one item per child item) change nothing;
* ``Batch(ConstantScheme(k))`` over examples groups k of them: a cut must fall after a
  multiple of k examples, so the unit grows to the fewest requests giving a multiple
  of k examples;
* ``Cache(ConstantScheme(k))`` re-cuts batches into batches of k examples: the same,
  counted in examples;
* ``Unpack`` turns each batch into its examples (known when the root's scheme tells the
  batch size);
* ``Filter`` drops an unknown number of items: fine at any cut on its own, but nothing
  above it can count, so a Batch or Cache above a Filter cannot be aligned;
* ``Merge`` zips several streams with their own schemes: never aligned.

A user transformer can say it is not one-to-one with a class attribute
``one_to_one = False`` (it is then treated like Filter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["Alignment", "analyse", "request_size"]


@dataclass(frozen=True)
class Alignment:
    """What the chain allows.

    Attributes:
        unit: the fewest consecutive root requests after which a cut is exact; None if
            no cut is (the chain regroups items it cannot count).
        map_only: every root request yields exactly one top-level batch.
        epoch_batches: batches the top stream yields per epoch, when computable.
        batches_per_unit: batches the top stream yields per full unit, when computable.
        reason: why the chain cannot be cut ('' when it can).
    """

    unit: int | None
    map_only: bool
    epoch_batches: int | None
    batches_per_unit: int | None
    reason: str = ""


def request_size(request: Any) -> int:
    """The number of examples a request asks for (1 for a single index)."""
    if isinstance(request, slice):
        start, stop, step = request.start or 0, request.stop, request.step or 1
        return max(0, math.ceil((stop - start) / step)) if stop is not None else 0
    if isinstance(request, (list, tuple)) or hasattr(request, "__len__"):
        return len(request)
    return 1


def _scheme_batch_size(scheme: Any) -> int | None:
    """k for an endless ConstantScheme(k); None for anything else."""
    if type(scheme).__name__ != "ConstantScheme":
        return None
    if getattr(scheme, "times", None) is not None or getattr(scheme, "num_examples", None):
        return None
    size = getattr(scheme, "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _chain_from_root(stream: Any) -> list[Any] | None:
    chain = []
    node = stream
    while node is not None:
        if getattr(node, "data_streams", None):
            return None  # Merge: several roots
        chain.append(node)
        node = getattr(node, "data_stream", None)
    chain.reverse()
    return chain


def analyse(stream: Any, requests: list[Any]) -> Alignment:
    """Work out the alignment of ``stream`` given one epoch's root requests.

    Args:
        stream: the top of the chain.
        requests: the root scheme's requests of one epoch.
    """
    chain = _chain_from_root(stream)
    if chain is None:
        return _uncut("Merge zips streams with their own schemes")
    walk = _Walk.at_root(chain[0], requests)
    for node in chain[1:]:
        why = walk.step(node)
        if why:
            return _uncut(why)
    return Alignment(walk.unit, walk.map_only, walk.items, walk.ipu)


def _uncut(reason: str) -> Alignment:
    return Alignment(None, False, None, None, reason)


@dataclass
class _Walk:
    """The state while walking up the chain: root requests per unit, items per unit
    (``ipu``), examples per item (``isz``), and for the whole epoch: items and examples
    (None where a node above made them uncountable)."""

    unit: int
    ipu: int | None
    isz: int | None
    items: int | None
    examples: int | None
    map_only: bool = True

    @classmethod
    def at_root(cls, root: Any, requests: list[Any]) -> _Walk:
        """At the root stream, whose scheme made ``requests``."""
        if getattr(root.iteration_scheme, "requests_examples", False):  # one example each
            return cls(1, 1, 1, len(requests), len(requests))
        return cls(1, 1, _same_size(requests), len(requests), sum(map(request_size, requests)))

    def step(self, node: Any) -> str:
        """One node up; why the chain cannot be cut there ('' if it can)."""
        name = type(node).__name__
        if name in ("Batch", "Cache"):
            return self._regroup(node, name)
        if name == "Unpack":
            self.ipu = (
                self.ipu * self.isz if self.ipu is not None and self.isz is not None else None
            )
            self.items, self.isz, self.map_only = self.examples, 1, False
        elif name == "Filter" or getattr(node, "one_to_one", True) is False:
            self.ipu, self.items, self.examples, self.map_only = None, None, None, False
        return ""

    def _regroup(self, node: Any, name: str) -> str:
        """Batch (items) or Cache (examples) into groups of k: the unit grows to the
        fewest requests giving a multiple of k."""
        k = _scheme_batch_size(node.iteration_scheme)
        per_unit = self.ipu if name == "Batch" else _times(self.ipu, self.isz)
        if k is None or per_unit is None:
            why = "its scheme is not an endless ConstantScheme" if k is None else ""
            return f"{name} regroups items it cannot count {why}".strip()
        m = k // math.gcd(per_unit, k)
        self.unit, self.ipu, self.isz = self.unit * m, per_unit * m // k, k
        total = self.items if name == "Batch" else self.examples
        if total is None:
            self.items = None
        else:
            self.examples = total
            strict = getattr(node, "strictness", 0)
            self.items = math.ceil(total / k) if strict == 0 else total // k
        self.map_only = False
        return ""


def _same_size(requests: list[Any]) -> int | None:
    """The examples every request but the last asks for, if they all ask for as many."""
    if not requests:
        return None
    sizes = {request_size(r) for r in requests[:-1]} or {request_size(requests[0])}
    return sizes.pop() if len(sizes) == 1 else None


def _times(a: int | None, b: int | None) -> int | None:
    return a * b if a and b else None
