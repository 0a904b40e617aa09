"""TrainerCheckpoint (consumer/torch_frameworks.py) without transformers: the events it
uses, the ones it ignores, and its refusals. The Trainer itself runs in
tests/consumer/test_hf_trainer.py (2 ranks, a kill and a resume). Accelerate's
IterableDatasetShard around a stream, refused (its DataLoaderDispatcher is refused in
tests/consumer/test_accelerate.py's 2-rank job, with the shard again)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("torch")

from batchq.errors import ConfigError
from consumer import ServerDataStream
from consumer.torch import DataLoaderDispatchError, TorchStream
from consumer.torch_frameworks import TRAINER_STATE_KEY, HeapLooks, TrainerCheckpoint

#: Where the streams of these tests would connect, were they to: nothing listens there.
NO_SERVER = "redis://127.0.0.1:1/0"


class FakeStream:
    """Stands in for a stream: counts state_dict() calls, keeps what is loaded."""

    def __init__(self) -> None:
        self.saved = 0
        self.loaded: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        self.saved += 1
        return {"epoch": 1, "step": self.saved}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded.append(state)


def control(save: bool = False, evaluate: bool = False) -> SimpleNamespace:
    return SimpleNamespace(should_save=save, should_evaluate=evaluate)


def test_the_state_is_kept_where_the_trainer_may_save_and_loaded_on_resume() -> None:
    stream = FakeStream()
    cb = TrainerCheckpoint(stream)
    args = SimpleNamespace(ignore_data_skip=False)
    state = SimpleNamespace(stateful_callbacks={}, global_step=0)
    cb.on_init_end(args, state, control())
    assert args.ignore_data_skip is True  # the stream, not the Trainer, skips
    cb.on_step_end(args, state, control())
    assert stream.saved == 0 and TRAINER_STATE_KEY not in state.stateful_callbacks
    cb.on_step_end(args, state, control(save=True))
    cb.on_epoch_end(args, state, control(evaluate=True))  # a best-model save may follow
    kept = state.stateful_callbacks[TRAINER_STATE_KEY]
    assert kept == {"args": {}, "attributes": {"state": {"epoch": 1, "step": 2}}}
    cb.on_train_begin(args, SimpleNamespace(stateful_callbacks={}, global_step=0), control())
    assert stream.loaded == []  # a fresh train(): nothing to resume
    resumed = SimpleNamespace(stateful_callbacks={TRAINER_STATE_KEY: kept}, global_step=6)
    cb.on_train_begin(args, resumed, control())
    assert stream.loaded == [{"epoch": 1, "step": 2}]


def test_a_resume_the_trainer_would_also_skip_is_refused_naming_the_fix() -> None:
    stream = FakeStream()
    cb = TrainerCheckpoint(stream)
    kept = {"args": {}, "attributes": {"state": {"epoch": 0}}}
    state = SimpleNamespace(stateful_callbacks={TRAINER_STATE_KEY: kept}, global_step=3)
    with pytest.raises(ConfigError, match="ignore_data_skip=True"):
        cb.on_train_begin(SimpleNamespace(ignore_data_skip=False), state, control())
    assert stream.loaded == []


@pytest.mark.parametrize("bad", [{"args": {}}, {"attributes": {"state": [1, 2]}}])
def test_a_malformed_saved_state_is_refused_naming_it(bad: dict[str, Any]) -> None:
    cb = TrainerCheckpoint(FakeStream())
    state = SimpleNamespace(stateful_callbacks={TRAINER_STATE_KEY: bad}, global_step=3)
    with pytest.raises(ConfigError, match="stateful_callbacks"):
        cb.on_train_begin(SimpleNamespace(ignore_data_skip=True), state, control())


def test_the_events_it_does_not_use_do_nothing_and_other_names_are_missing() -> None:
    cb = TrainerCheckpoint(FakeStream())
    assert cb.on_log(None, None, None, logs={}) is None
    assert cb.on_prediction_step(None, None, None) is None
    with pytest.raises(AttributeError, match="state"):
        cb.state  # noqa: B018  # not an ExportableState: the Trainer's restore skips it


def test_accelerates_iterable_dataset_shard_is_refused_naming_the_fix() -> None:
    # dispatch_batches=False: Accelerate wraps the loader's dataset in its
    # IterableDatasetShard, which would keep every R-th batch of this rank's share (and
    # fails on batch_size=None with a TypeError of its own): refused first, at len() and
    # at its first batch, naming what to do instead.
    data_loader = pytest.importorskip("accelerate.data_loader")
    import torch

    ts = TorchStream(ServerDataStream(("features",), False, url=NO_SERVER))
    prepared = data_loader.prepare_data_loader(
        torch.utils.data.DataLoader(ts, batch_size=None),
        num_processes=2,
        process_index=1,
        put_on_device=False,
        dispatch_batches=False,
    )
    assert isinstance(prepared.dataset, data_loader.IterableDatasetShard)
    with pytest.raises(DataLoaderDispatchError, match="IterableDatasetShard") as info:
        len(prepared)  # a training script's scheduler asks first
    assert "Pass the stream itself to accelerator.prepare()" in str(info.value)
    assert isinstance(info.value, ConfigError)
    with pytest.raises(DataLoaderDispatchError, match="IterableDatasetShard"):
        next(iter(prepared))
    unwrapped = TorchStream(ServerDataStream(("features",), False, url=NO_SERVER))
    assert not hasattr(unwrapped, "generator")  # a missing attribute as any other


def test_heap_looks_scan_once_per_count_until_forgotten_and_again_after_a_refusal() -> None:
    # Two call sites with their own temporaries (the transformers Trainer asks len()
    # from several): each count is scanned once, not at every alternation, until a
    # wrapper may have been made (forget); a scan that raised or did not look is not
    # remembered, so the wrapper is refused every time.
    looks, scanned = HeapLooks(), []

    def clean(dataset: object) -> bool:
        scanned.append(dataset)
        return True

    for refs in [5, 6, 5, 6, 5]:
        looks.look(refs, clean, "ds")
    assert scanned == ["ds", "ds"]
    looks.forget()
    looks.look(5, clean, "ds")
    assert len(scanned) == 3

    def refuse(dataset: object) -> bool:
        raise DataLoaderDispatchError("wrapped")

    for _ in range(2):
        with pytest.raises(DataLoaderDispatchError):
            looks.look(7, refuse, "ds")
    looks.look(8, lambda ds: False, "ds")  # did not look (accelerate not imported)
    looks.look(8, clean, "ds")
    assert len(scanned) == 4


def test_a_dispatcher_made_after_a_plain_loader_was_iterated_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A peek or a dry run through a plain DataLoader first, then the usual
    # `loader = prepare(loader)`: the dispatcher's inner loader takes the reference the
    # plain one dropped, so the stream's reference count is one a look found clean.
    data_loader = pytest.importorskip("accelerate.data_loader")
    import torch

    monkeypatch.setattr(ServerDataStream, "__len__", lambda self: 4)  # the dispatcher asks
    ts = TorchStream(ServerDataStream(("features",), False, url=NO_SERVER, timeout_s=5))
    loader = torch.utils.data.DataLoader(ts, batch_size=None)
    iter(loader)  # its iter(ts): no dispatcher then (a generator: nothing read)
    loader = data_loader.prepare_data_loader(
        loader,
        num_processes=2,
        process_index=0,
        dispatch_batches=True,
        put_on_device=True,
        device=torch.device("cpu"),
    )
    with pytest.raises(DataLoaderDispatchError, match="DataLoaderDispatcher"):
        next(iter(loader))
