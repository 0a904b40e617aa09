"""``on_sample_error='quarantine'`` for Fuel pipelines, in this process: a DataStream over an
indexable dataset read by a batch scheme or an example scheme (batched above). The
substitutes are a pure function of (scheme's seed, epoch, index), whatever a producer met
before; the cap; what is refused. (Served by producer processes:
tests/producer/test_fuel_quarantine_served.py.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fuel_quarantine import FEATURES, BrokenIndexable, dataset, example_stream, iterable_stream

from batchq.errors import ConfigError
from producer.datasets import IndexableDataset
from producer.errors import ExampleKilled, QuarantineExceeded
from producer.quarantine import MAX_DRAWS, LocalRecords, set_sample_errors, substitute_draw
from producer.schemes import ConstantScheme, SequentialScheme, ShuffledScheme
from producer.serving.sharding import ShardPlan
from producer.streams import DataStream
from producer.transformers import Mapping, Merge

N, BATCH, SEED = 200, 10, 7
BAD = {5, 77, 150}

Batch = tuple[bytes, ...]


def stream(fraction: float = 0.02, mode: str = "quarantine", bad: set[int] = BAD) -> DataStream:
    scheme = ShuffledScheme(N, BATCH, rng=SEED)
    return DataStream(
        dataset(N, bad), iteration_scheme=scheme, on_sample_error=mode, max_quarantined=fraction
    )


def shard_bytes(s: Any, epoch: int, shard: int) -> list[Batch]:
    return [
        tuple(np.asarray(v).tobytes() for v in b) for b in ShardPlan(s).iter_shard(epoch, shard)
    ]


def indices(batches: list[Batch]) -> list[list[int]]:
    return [(np.frombuffer(b[0], np.int64)[::FEATURES] // FEATURES).tolist() for b in batches]


def planned(requests: list[list[int]], epoch: int, seed: int, pool: int = N) -> list[list[int]]:
    """The scheme's requests with every bad example replaced by its first drawn
    substitute that is not bad."""

    def substitute(i: int) -> int:
        for t in range(MAX_DRAWS):
            j = substitute_draw(seed, epoch, i, t, pool)
            if j not in BAD:
                return j
        raise AssertionError(f"no substitute for {i}")

    return [[substitute(i) if i in BAD else i for i in r] for r in requests]


def test_full_batches_with_the_same_substitutes_whatever_the_producer_met_before() -> None:
    first = stream()
    plan = ShardPlan(first)
    seen = {(e, k): shard_bytes(first, e, k) for e in range(2) for k in range(plan.shards)}
    for e in range(2):
        got = [i for k in range(plan.shards) for i in indices(seen[e, k])]
        want = planned(plan.requests(e), e, first.iteration_scheme.seed)
        assert got == want  # the plan, every batch full, substitutes where bad
        assert not BAD & {i for b in got for i in b}
    assert first.sample_errors is not None and first.sample_errors.known_bad == BAD
    # A producer that builds the shards in another order, alone (a rebuild elsewhere),
    # and one that met every bad example already: the same bytes.
    for k in reversed(range(plan.shards)):
        assert shard_bytes(stream(), 1, k) == seen[1, k]
        assert shard_bytes(first, 1, k) == seen[1, k]


def test_the_records_say_index_epoch_and_error_and_known_bad_examples_are_not_read_again() -> None:
    s = stream()
    plan = ShardPlan(s)
    for k in range(plan.shards):
        list(plan.iter_shard(0, k))
    errors = s.sample_errors
    assert errors is not None and isinstance(errors.records, LocalRecords)
    records = {r["index"]: r for r in errors.records.listing(10)}
    assert sorted(records) == sorted(BAD)
    for i, r in records.items():
        assert (r["epoch"], r["error_type"]) == (0, "ValueError")
        assert r["message"] == f"example {i}: corrupt record"
        assert "raise ValueError" in r["traceback"] and r["substitute"] not in BAD
    ds = s.dataset
    assert isinstance(ds, BrokenIndexable)
    reads = {i: ds.reads[i] for i in BAD}
    for k in range(plan.shards):
        list(plan.iter_shard(1, k))
    assert {i: ds.reads[i] for i in BAD} == reads  # skipped without a read


def test_an_example_scheme_batched_above_keeps_every_batch_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TEST_BAD", ",".join(map(str, BAD)))
    s = example_stream(N, BATCH)
    set_sample_errors(s, "quarantine", 0.02)
    plan = ShardPlan(s)
    assert plan.requests_per_shard == BATCH
    for e in range(2):
        batches = [b for k in range(plan.shards) for b in plan.iter_shard(e, k)]
        got = [(b[0][:, 0] // FEATURES).tolist() for b in batches]
        sequential = [list(range(a, a + BATCH)) for a in range(0, N, BATCH)]
        assert got == planned(sequential, e, 0)  # a scheme without a seed: 0
        assert all(len(b[2]) == BATCH for b in batches)  # the noise drawn per example


def test_a_scheme_over_a_subset_draws_substitutes_inside_it() -> None:
    scheme = SequentialScheme(list(range(100, 200)), BATCH)
    s = DataStream(dataset(N, BAD), iteration_scheme=scheme, on_sample_error="quarantine")
    got = [i for b in s.get_epoch_iterator() for i in (b[0][:, 0] // FEATURES).tolist()]
    assert len(got) == 100 and 150 not in got and all(100 <= i < 200 for i in got)


def test_without_quarantine_the_read_raises_naming_the_example() -> None:
    s = stream(mode="raise")
    assert s.sample_errors is None
    with pytest.raises(ValueError, match=r"example (5|77|150): corrupt record"):
        for _ in s.get_epoch_iterator():
            pass


def test_past_max_quarantined_the_build_raises_naming_the_examples() -> None:
    s = stream(fraction=0.01)  # 2 of 200 examples may be quarantined: 3 raise
    with pytest.raises(QuarantineExceeded) as caught:
        for _ in s.get_epoch_iterator():
            pass
    text = str(caught.value)
    assert "max_quarantined=0.01" in text
    assert sum(f"{i} (ValueError: example {i}: corrupt record)" in text for i in BAD) == 3


def test_a_batch_that_fails_only_as_a_whole_fails_as_before() -> None:
    class Together(IndexableDataset):
        def get_data(self, state: Any = None, request: Any = None) -> Any:
            if isinstance(request, list) and {3, 4} <= set(request):
                raise OSError("3 and 4 cannot be read together")
            return super().get_data(state, request)

    s = DataStream(
        Together(np.arange(20)), iteration_scheme=SequentialScheme(20, 5),
        on_sample_error="quarantine",
    )  # fmt: skip
    with pytest.raises(OSError, match="cannot be read together"):
        list(s.get_epoch_iterator())
    assert s.sample_errors is not None and not s.sample_errors.known_bad  # none condemned


def test_the_plan_fingerprint_names_quarantine_through_the_transformers() -> None:
    def top(root: DataStream) -> Any:
        return Mapping(root, lambda d: d)

    plain = ShardPlan(top(stream(mode="raise")))
    quarantined = ShardPlan(top(stream()))
    set_later = stream(mode="raise")
    set_sample_errors(top(set_later), "quarantine", 0.02)
    assert stream(mode="raise").plan_fingerprint is None  # a plain stream's: unchanged
    assert quarantined.fingerprint != plain.fingerprint
    assert ShardPlan(top(set_later)).fingerprint == quarantined.fingerprint


def test_quarantine_is_refused_where_no_example_is_read_alone() -> None:
    with pytest.raises(ConfigError, match=r"without an iteration scheme.*example indices"):
        set_sample_errors(iterable_stream(), "quarantine", None)
    features = np.arange(40).reshape(20, 2)
    sizes = DataStream(IndexableDataset(features), iteration_scheme=ConstantScheme(4, 20))
    with pytest.raises(ConfigError, match="read by ConstantScheme"):
        sizes.set_sample_errors("quarantine", None)
    merged = Merge([stream(mode="raise"), stream(mode="raise")], ("a", "b", "c", "d"))
    with pytest.raises(ConfigError, match="given for Merge: expected"):
        set_sample_errors(merged, "quarantine", None)
    # Set on a branch's own DataStream: no root of the chain, so refused by the plan
    # (the run's records, the fingerprint and isolation look at the root alone).
    branch = Merge([stream(), stream(mode="raise")], ("a", "b", "c", "d"))
    with pytest.raises(ConfigError, match="set on a DataStream below Merge: expected"):
        ShardPlan(branch)
    outside = DataStream(IndexableDataset(features), iteration_scheme=SequentialScheme(30, 5))
    with pytest.raises(ConfigError, match="indices 0 to 29, outside the dataset's 20"):
        outside.set_sample_errors("quarantine", None)
    with pytest.raises(ConfigError, match="on_sample_error 'skip' is not valid"):
        stream(mode="skip")
    with pytest.raises(ConfigError, match="max_quarantined 2 is not valid"):
        stream(fraction=2)
    set_sample_errors(iterable_stream(), "raise", None)  # the default is taken anywhere


def test_isolated_an_example_that_kills_its_reader_is_named_or_quarantined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TEST_ABORT", "33")  # read in a forked child only: it aborts there
    plain = stream(mode="raise", bad=set())
    assert plain.isolate(True, 5.0)
    with pytest.raises(ExampleKilled, match="the producer died \\(SIGABRT\\) building example 33"):
        list(plain.get_epoch_iterator())
    plain.isolate(False)
    s = stream(bad=BAD)
    assert s.isolate(True, 5.0)
    got = [i for b in s.get_epoch_iterator() for i in (b[0][:, 0] // FEATURES).tolist()]
    s.isolate(False)
    assert len(got) == N and not {33, *BAD} & set(got)
    assert s.sample_errors is not None
    killed = [r for r in s.sample_errors.records.listing(10) if r["index"] == 33]
    assert [r["error_type"] for r in killed] == ["ExampleKilled"]
    assert not iterable_stream().data_stream.isolate(True, 5.0)  # no example read alone
