"""A tiny name -> factory registry, one per pluggable family.

The registered name is the Hydra option name: ``attention=sdpa`` on the command line and
``@ATTENTION_BACKENDS.register("sdpa")`` in code are the same word.
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to factories. ``lazy`` entries name a module whose import registers the factory."""

    def __init__(self, family: str, lazy: dict[str, str] | None = None) -> None:
        self.family = family
        self._factories: dict[str, Callable[..., T]] = {}
        self._lazy: dict[str, str] = dict(lazy or {})

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def deco(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._factories and self._factories[name] is not factory:
                raise ValueError(f"{self.family} '{name}' registered twice")
            self._factories[name] = factory
            return factory

        return deco

    def names(self) -> list[str]:
        return sorted(set(self._factories) | set(self._lazy))

    def get(self, name: str) -> Callable[..., T]:
        if name not in self._factories and name in self._lazy:
            importlib.import_module(self._lazy[name])
        if name not in self._factories:
            raise KeyError(f"unknown {self.family} '{name}'; available: {', '.join(self.names())}")
        return self._factories[name]

    def build(self, name: str, *args, **kwargs) -> T:
        return self.get(name)(*args, **kwargs)
