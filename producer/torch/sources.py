"""What a ``collate_fn`` returns, as the named sources of a frame.

torch's ``default_collate`` (or the user's ``collate_fn``) returns tensors, numpy
arrays, numbers, strings, or tuples, lists and dicts of them. A frame carries a flat
tuple of named values, so the batch is flattened:

* a dict's keys are the source names (``{'image': ..., 'label': ...}``);
* a tuple's or list's positions are named ``'0'``, ``'1'``, ... (:func:`flatten`), or by
  the stream's ``sources=`` (:class:`SourceLayout`);
* nested containers join their names with dots (``('0', '1.mask', '1.boxes')``); a list
  that holds no tensor or array anywhere (``['cat', 'dog']``, lists of token ids) is one
  value, sent as msgpack;
* a tensor travels as its bytes: ``tensor.numpy()`` is a view of the tensor's memory
  (kept alive by the view), so the frame is written from it without a copy; the
  trainer gets numpy arrays from ``ServerDataStream`` and tensors from ``TorchStream``.

The first batch's names are the stream's sources; a later batch with other names is
an error naming both.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from batchq.errors import ConfigError

__all__ = ["SourceLayout", "flatten"]


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _holds_arrays(value: Any) -> bool:
    """Whether a container holds a tensor, an array or a dict anywhere inside."""
    if _is_tensor(value) or isinstance(value, np.ndarray | Mapping):
        return True
    if isinstance(value, list | tuple):
        return any(_holds_arrays(v) for v in value)
    return False


def _to_numpy(name: str, tensor: Any) -> np.ndarray:
    """A CPU view of ``tensor``'s memory (a copy only for tensors off the CPU)."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    try:
        return np.asarray(t.numpy())
    except TypeError as e:  # bfloat16 and other dtypes numpy has no equal of
        hint = " (cast it to float32 in collate_fn)" if t.dtype == torch.bfloat16 else ""
        raise ConfigError(
            f"source {name!r}: a tensor of dtype {t.dtype} cannot travel{hint}: {e}"
        ) from None


def _leaves(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _leaves(item, f"{prefix}{key}.")
    elif isinstance(value, list | tuple) and _holds_arrays(value):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{prefix}{i}.")
    else:
        name = prefix[:-1]
        yield name, _to_numpy(name, value) if _is_tensor(value) else value


def flatten(batch: Any) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """A collated batch as (names, values), names in the batch's own order.

    The top level is always a container: a tuple or list gives positions even when it
    holds plain values only, a single value is source ``'0'``.
    """
    if isinstance(batch, Mapping):
        pairs = list(_leaves(batch, ""))
    elif isinstance(batch, list | tuple):
        pairs = []
        for i, item in enumerate(batch):
            pairs.extend(_leaves(item, f"{i}.") if _holds_arrays(item) else [(str(i), item)])
    else:
        pairs = list(_leaves(batch, "0."))
    names = tuple(n for n, _ in pairs)
    if len(set(names)) != len(names):
        raise ConfigError(f"the batch's sources {names} repeat a name: expected unique names")
    return names, tuple(v for _, v in pairs)


class SourceLayout:
    """The sources of a stream, fixed by its first batch.

    Args:
        names: the first batch's flattened names (see :func:`flatten`).
        top_is_dict: whether the first batch was a dict (its keys name the sources).
        sources: the user's names for the flattened values, in order, or None.

    Raises:
        ConfigError: ``sources`` has another length than the batch has values, names a
            source twice, or renames a dict's keys.
    """

    def __init__(
        self, names: tuple[str, ...], top_is_dict: bool, sources: Sequence[str] | None
    ) -> None:
        self.batch_names = names
        if sources is None:
            self.sources = names
            return
        wanted = tuple(sources)
        if top_is_dict:
            raise ConfigError(
                f"sources={wanted!r} is not valid here: the batches are dicts, whose keys "
                f"{names} name the sources (rename them in collate_fn)"
            )
        if len(wanted) != len(names) or len(set(wanted)) != len(wanted):
            raise ConfigError(
                f"sources={wanted!r} is not valid: the batches hold {len(names)} values "
                f"({', '.join(names)}); expected {len(names)} distinct names"
            )
        if not all(isinstance(s, str) and s for s in wanted):
            raise ConfigError(f"sources={wanted!r} is not valid: expected non-empty strings")
        self.sources = wanted

    def values(self, batch: Any) -> tuple[Any, ...]:
        """The batch's values in source order.

        Raises:
            ConfigError: the batch has other sources than the first one had.
        """
        names, values = flatten(batch)
        if names != self.batch_names:
            raise ConfigError(
                f"a batch has the sources {names}: expected {self.batch_names}, those of "
                "the first batch (collate_fn must return the same structure every time)"
            )
        return values
