"""The errors users can cause, each with a one-line message naming the value and what is allowed.

A module of its own so that configuration (``framework.config``), request validation (``framework.sampling``)
and everything above them can raise and catch them without importing each other.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration value or override; ``str(err)`` is one line for the user."""


class RequestError(ValueError):
    """A bad request (prompt or sampling field); ``str(err)`` is one line naming the field and what is allowed."""
