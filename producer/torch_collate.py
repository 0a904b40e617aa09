"""What a ``collate_fn`` returns, as the named sources of a frame.

torch's ``default_collate`` (or the user's ``collate_fn``) returns tensors, numpy
arrays, numbers, strings, or tuples, lists and dicts of them. A frame carries a flat
tuple of named values, so the batch is flattened:

* a dict's keys are the source names (``{'image': ..., 'label': ...}``);
* a tuple's or list's positions are named by the stream's ``sources=``, else ``'0'``,
  ``'1'``, ...;
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

from collections.abc import Sequence
from typing import Any

from batchq.errors import ConfigError
from producer.torch_flatten import flatten

__all__ = ["SourceLayout"]


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
