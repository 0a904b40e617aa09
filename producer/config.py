"""Fuel's ``fuel.config`` settings that a pipeline reads: ``floatX`` and ``default_seed``.

``from producer import config`` then ``config.floatX`` works as in Fuel. ``floatX`` is
read from the environment each time it is asked for: ``BATCHQ_FLOATX``, else
``FUEL_FLOATX`` (so a Fuel user's setting carries over), else ``'float32'``. Assigning
``config.floatX = 'float64'`` overrides the environment for this process, as in Fuel.
Every other setting is an argument in batchq (see the README's porting table).
"""

from __future__ import annotations

import os
from typing import Any

from producer.errors import ConfigError
from producer.randomness import DEFAULT_SEED

__all__ = ["FLOATX_VARIABLES", "default_seed", "floatx"]

#: The environment variables read for floatX, first found wins.
FLOATX_VARIABLES = ("BATCHQ_FLOATX", "FUEL_FLOATX")
_FLOAT_TYPES = ("float16", "float32", "float64")

#: The seed of components left at ``rng=None`` (Fuel's ``config.default_seed``).
default_seed = DEFAULT_SEED


def floatx() -> str:
    """The configured floatX: ``'float16'``, ``'float32'`` (default) or ``'float64'``.

    Raises:
        ConfigError: the variable holds another value (the message names it).
    """
    assigned = globals().get("floatX")
    if assigned is not None:
        name, value = "producer.config.floatX", str(assigned)
    else:
        name, value = "", "float32"
        for variable in FLOATX_VARIABLES:
            if os.environ.get(variable):
                name, value = variable, os.environ[variable].strip()
                break
    if value not in _FLOAT_TYPES:
        raise ConfigError(f"{name}={value!r} is not valid: expected one of {_FLOAT_TYPES}")
    return value


def __getattr__(name: str) -> Any:
    # ``config.floatX`` read live (until assigned): a module-level property.
    if name == "floatX":
        return floatx()
    raise AttributeError(f"module 'producer.config' has no attribute {name!r}")
