"""TrainerCheckpoint (consumer/torch_frameworks.py) without transformers: the events it
uses, the ones it ignores, its refusals, and the Trainer's skip of a resumed epoch's
trained batches passing the stream by (a stand-in ``transformers.trainer``). The Trainer
itself runs in tests/consumer/test_hf_trainer.py (2 ranks, a kill and a resume; gradient
accumulation). Accelerate's IterableDatasetShard around a stream, refused (its
DataLoaderDispatcher is refused in tests/consumer/test_accelerate.py's 2-rank job, with
the shard again)."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
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


@pytest.fixture
def trainer_module(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A stand-in ``transformers.trainer`` whose ``skip_first_batches`` records its
    calls (the Trainer's resume of a mid-epoch checkpoint calls it); gone afterwards."""
    module = ModuleType("transformers.trainer")
    skipped: list[tuple[Any, int]] = []

    def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
        skipped.append((dataloader, num_batches))
        return "skipped"

    module.skipped = skipped  # type: ignore[attr-defined]
    module.skip_first_batches = skip_first_batches  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers.trainer", module)
    return module


@pytest.fixture
def no_trainer_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``transformers.trainer`` imported (as a transformers without its
    ``skip_first_batches``)."""
    monkeypatch.delitem(sys.modules, "transformers.trainer", raising=False)


def test_the_state_is_kept_where_the_trainer_may_save_and_loaded_on_resume(
    trainer_module: ModuleType,
) -> None:
    stream = FakeStream()
    cb = TrainerCheckpoint(stream)
    args = SimpleNamespace(ignore_data_skip=True, gradient_accumulation_steps=3)
    state = SimpleNamespace(stateful_callbacks={}, global_step=0)
    cb.on_init_end(args, state, control())
    assert args.ignore_data_skip is False  # the Trainer counts what the stream skips
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


def test_the_trainers_skip_passes_the_stream_by_and_no_other_loader(
    trainer_module: ModuleType,
) -> None:
    # A resume from a checkpoint taken mid-epoch: the Trainer "skips" the epoch's
    # trained batches, and so counts them (its steps, optimizer steps and state.epoch go
    # on as in the run that was not stopped); the stream is there already. A loader of
    # another stream is skipped as the Trainer would; the hook is made once.
    stream, other = FakeStream(), FakeStream()
    original = trainer_module.skip_first_batches
    callbacks = [TrainerCheckpoint(stream), TrainerCheckpoint(FakeStream())]  # the Trainer's
    for cb in callbacks:
        cb.on_init_end(SimpleNamespace(), None, control())
    skip = trainer_module.skip_first_batches
    assert skip is not original and skip.__wrapped__ is original  # one wrapper
    assert skip(stream, 3) is stream
    loader = SimpleNamespace(dataset=stream)  # a DataLoader(stream, batch_size=None)
    assert skip(loader, 3) is loader
    assert skip(other, 3) == "skipped"
    assert skip(SimpleNamespace(dataset=other), num_batches=6) == "skipped"
    assert [n for _, n in trainer_module.skipped] == [3, 6]


def test_a_resume_that_would_count_the_epoch_from_its_first_batch_is_refused(
    trainer_module: ModuleType,
) -> None:
    # ignore_data_skip=True set after the Trainer was made: it would count the resumed
    # epoch's batches from 0 and, accumulating gradients, never make its last step.
    stream = FakeStream()
    cb = TrainerCheckpoint(stream)
    kept = {"args": {}, "attributes": {"state": {"epoch": 0}}}
    state = SimpleNamespace(stateful_callbacks={TRAINER_STATE_KEY: kept}, global_step=3)
    with pytest.raises(ConfigError, match="ignore_data_skip=False") as info:
        cb.on_train_begin(SimpleNamespace(ignore_data_skip=True), state, control())
    assert "gradient_accumulation_steps" in str(info.value)
    assert stream.loaded == []
    cb.on_train_begin(SimpleNamespace(ignore_data_skip=False), state, control())
    assert stream.loaded == [{"epoch": 0}]  # a callback added after the Trainer was made


def test_without_the_trainers_skip_the_trainer_does_not_skip_at_all(
    no_trainer_module: None,
) -> None:
    # A transformers without transformers.trainer.skip_first_batches: the Trainer must
    # not skip the stream's batches (they would be skipped twice); with gradient
    # accumulation a warning says what is then not exact.
    stream = FakeStream()
    cb = TrainerCheckpoint(stream)
    args = SimpleNamespace(ignore_data_skip=False, gradient_accumulation_steps=1)
    cb.on_init_end(args, None, control())
    assert args.ignore_data_skip is True
    with pytest.warns(UserWarning, match="merges that epoch's last optimizer step"):
        cb.on_init_end(SimpleNamespace(gradient_accumulation_steps=2), None, control())
    kept = {"args": {}, "attributes": {"state": {"epoch": 0}}}
    state = SimpleNamespace(stateful_callbacks={TRAINER_STATE_KEY: kept}, global_step=3)
    with pytest.raises(ConfigError, match="ignore_data_skip=True"):
        cb.on_train_begin(SimpleNamespace(ignore_data_skip=False), state, control())
    assert stream.loaded == []
    cb.on_train_begin(args, state, control())
    assert stream.loaded == [{"epoch": 0}]


@pytest.mark.parametrize("bad", [{"args": {}}, {"attributes": {"state": [1, 2]}}])
def test_a_malformed_saved_state_is_refused_naming_it(
    bad: dict[str, Any], trainer_module: ModuleType
) -> None:
    cb = TrainerCheckpoint(FakeStream())
    state = SimpleNamespace(stateful_callbacks={TRAINER_STATE_KEY: bad}, global_step=3)
    with pytest.raises(ConfigError, match="stateful_callbacks"):
        cb.on_train_begin(SimpleNamespace(ignore_data_skip=False), state, control())


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
