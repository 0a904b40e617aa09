"""DataLoader's arguments and their checks (producer/torch/loader_args.py)."""

from __future__ import annotations

from typing import Any

import pytest

from batchq.errors import ConfigError
from producer.config import default_seed
from producer.torch.loader_args import (
    LoaderArgs,
    check_batching,
    check_common,
    check_iterable,
    check_seed,
    check_threads,
)


def _args(**changes: Any) -> LoaderArgs:
    given: dict[str, Any] = dict(
        dataset=range(10), batch_size=2, shuffle=False, drop_last=False, collate_fn=None,
        generator=None, sampler=None, batch_sampler=None, sources=None, seed=None,
        num_shards=None, worker_init_fn=None, torch_threads=1,
    )  # fmt: skip
    given.update(changes)
    return LoaderArgs(**given)


def test_seed_defaults_to_fuels_and_refuses_what_is_not_a_natural_number() -> None:
    assert check_seed(None) == int(default_seed)
    assert check_seed(7) == 7
    for bad in (-1, True, 1.5, "3"):
        with pytest.raises(ConfigError, match=f"seed {bad!r} is not valid"):
            check_seed(bad)


def test_threads_are_none_or_at_least_one() -> None:
    assert check_threads(None) is None
    assert check_threads(4) == 4
    with pytest.raises(ConfigError, match="torch_threads 0 is not valid"):
        check_threads(0)


def test_common_arguments_name_the_bad_value() -> None:
    check_common(None, None, ("x",))
    with pytest.raises(ConfigError, match="batch_size 0 is not valid"):
        check_common(0, None, None)
    with pytest.raises(ConfigError, match="collate_fn 3 is not valid"):
        check_common(1, 3, None)
    with pytest.raises(ConfigError, match="sources 'xy' is not valid"):
        check_common(1, None, "xy")


def test_batching_exclusions_are_dataloaders() -> None:
    assert check_batching(4, False, False, None, None) == 4
    assert check_batching(1, False, False, None, [[0, 1]]) is None
    with pytest.raises(ConfigError, match="mutually exclusive with shuffle"):
        check_batching(1, True, False, [0], None)
    with pytest.raises(ConfigError, match="batch_sampler option is mutually exclusive"):
        check_batching(4, False, False, None, [[0, 1]])


def test_an_iterable_dataset_gets_its_shards_and_refuses_orders() -> None:
    assert check_iterable(_args()) == 1
    assert check_iterable(_args(num_shards=3)) == 3
    with pytest.raises(ConfigError, match="expected unspecified shuffle option"):
        check_iterable(_args(shuffle=True))
    with pytest.raises(ConfigError, match="batch_sampler and generator are not used"):
        check_iterable(_args(generator=object()))
    with pytest.raises(ConfigError, match="num_shards 0 is not valid"):
        check_iterable(_args(num_shards=0))
    with pytest.raises(ConfigError, match="worker_init_fn 5 is not valid"):
        check_iterable(_args(worker_init_fn=5))
