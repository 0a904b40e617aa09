"""Checks of mixtures' draws, shared by the mixture tests."""

from __future__ import annotations

from collections import Counter


def check_passes(seq: list[list[int]], size: int) -> None:
    """A source's examples, batch by batch: within each pass of ``size`` examples none
    repeats (a batch may end a pass and start the next one)."""
    seen: Counter[int] = Counter()
    for examples in seq:
        part = Counter(examples)
        missing = size - len(seen)
        if sum(part.values()) < missing:  # the batch stays within the pass
            assert not (set(part) & set(seen)) and max(part.values(), default=1) == 1
            seen += part
            continue
        ending = set(range(size)) - set(seen)  # the pass ends in this batch: these
        assert all(part[e] >= 1 for e in ending)
        rest = part - Counter(ending)
        assert not rest or max(rest.values()) == 1
        seen = rest
