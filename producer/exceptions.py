"""Fuel's module path ``fuel.exceptions``: the errors a Fuel script catches by name."""

from producer.errors import AxisLabelsMismatchError, ConfigError

#: Fuel's ``ConfigurationError`` (a setting is missing or wrong); here a ValueError too.
ConfigurationError = ConfigError

__all__ = ["AxisLabelsMismatchError", "ConfigurationError"]
