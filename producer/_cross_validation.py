"""Fuel's ``cross_validation``: (train, valid) scheme pairs for k-fold cross-validation
(exported by :mod:`producer.schemes`, Fuel's module path)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from producer._scheme_args import check_count
from producer.errors import ConfigError

__all__ = ["cross_validation"]


def cross_validation(
    scheme_class: Callable[..., Any],
    num_examples: int,
    num_folds: int,
    strict: bool = True,
    *,
    which_fold: int | None = None,
    **kwargs: Any,
) -> Any:
    """Build (train, valid) scheme pairs for k-fold cross-validation.

    Fold i validates on examples ``[num_examples*i//num_folds, num_examples*(i+1)//num_folds)``
    and trains on the others, as in Fuel.

    Args:
        scheme_class: an :class:`IndexScheme` or :class:`BatchScheme` subclass; it is
            called as ``scheme_class(indices, **kwargs)``.
        num_examples: the number of examples in the data.
        num_folds: the number of folds (1 <= num_folds <= num_examples).
        strict: require ``num_examples`` divisible by ``num_folds``; when False each
            tuple has a third element, the size of the validation set. The fourth
            positional argument, as in Fuel.
        which_fold: (keyword only, batchq's) if given, only that fold's tuple is
            returned (not an iterator).
        **kwargs: passed to ``scheme_class`` (e.g. ``batch_size``, ``rng``).

    Returns:
        An iterator over the ``num_folds`` tuples ``(train, valid)`` (or ``(train,
        valid, valid_size)`` when not strict), or one such tuple if ``which_fold`` is given.

    Raises:
        ConfigError: (a ``ValueError``; at the first ``next()`` when iterating, as in
            Fuel) the counts are invalid, or not divisible while ``strict``.
    """

    def folds() -> Iterator[tuple[Any, ...]]:
        # A generator, as Fuel's: bad counts raise at the first next(), where Fuel raises.
        examples, count = _check_folds(num_examples, num_folds, strict)
        for i in range(count):
            yield _fold(scheme_class, i, examples, count, strict, kwargs)

    if which_fold is None:
        return folds()
    examples, count = _check_folds(num_examples, num_folds, strict)
    if not 0 <= check_count("which_fold", which_fold) < count:
        raise ConfigError(
            f"which_fold={which_fold!r} is not valid: expected 0 <= which_fold < {count}"
        )
    return _fold(scheme_class, int(which_fold), examples, count, strict, kwargs)


def _check_folds(num_examples: Any, num_folds: Any, strict: bool) -> tuple[int, int]:
    """(examples, folds) of a cross-validation, checked (see :func:`cross_validation`)."""
    examples = check_count("num_examples", num_examples)
    folds = check_count("num_folds", num_folds)
    if not 1 <= folds <= max(examples, 1):
        raise ConfigError(
            f"num_folds={folds} is not valid: expected 1 <= num_folds <= num_examples ({examples})"
        )
    if strict and examples % folds:
        raise ConfigError(
            f"{examples} examples are not divisible into {folds} evenly-sized "
            "folds; pass strict=False to allow folds of different sizes"
        )
    return examples, folds


def _fold(
    scheme_class: Callable[..., Any],
    i: int,
    examples: int,
    folds: int,
    strict: bool,
    kwargs: dict[str, Any],
) -> tuple[Any, ...]:
    """Fold ``i``'s (train, valid[, valid size]) schemes."""
    begin = examples * i // folds
    end = examples * (i + 1) // folds
    train = scheme_class([*range(begin), *range(end, examples)], **kwargs)
    valid = scheme_class(list(range(begin, end)), **kwargs)
    return (train, valid) if strict else (train, valid, end - begin)
