"""A name -> class registry, shared by the tool-call and reasoning parser managers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class ParserRegistry(Generic[T]):
    """Classes registered under one or more names (``--tool-call-parser hermes`` ...).

    Args:
        kind: what is registered, for error messages ("tool", "reasoning").
        plural: the registry's name in error messages (vLLM's "tool_parsers", "reasoning_parsers").
    """

    def __init__(self, kind: str, plural: str) -> None:
        self.kind = kind
        self.plural = plural
        self.classes: dict[str, type[T]] = {}

    def get(self, name: str | None) -> type[T]:
        """The class registered as ``name``; KeyError (listing the known names) otherwise."""
        if name in self.classes:
            return self.classes[name]
        raise KeyError(
            f"{self.kind} helper: '{name}' not found in {self.plural} (available: {', '.join(self.names())})"
        )

    def names(self) -> list[str]:
        return sorted(self.classes)

    def register(self, name: str | list[str] | None = None, force: bool = True) -> Callable[[type[T]], type[T]]:
        """Class decorator registering under ``name`` (a list: several aliases; None: the class name)."""

        def decorate(cls: type[T]) -> type[T]:
            names = [cls.__name__] if name is None else [name] if isinstance(name, str) else list(name)
            for alias in names:
                if not force and alias in self.classes:
                    raise KeyError(f"{alias} is already registered at {self.classes[alias].__module__}")
                self.classes[alias] = cls
            return cls

        return decorate


class ParserManager:
    """Base of the vLLM-style managers: classmethods over one class-level :class:`ParserRegistry`."""

    registry: ParserRegistry

    @classmethod
    def list_registered(cls) -> list[str]:
        """The registered names, sorted."""
        return cls.registry.names()

    @classmethod
    def register_module(cls, name: str | list[str] | None = None, force: bool = True) -> Callable[[type], type]:
        """Class decorator registering a parser under ``name`` (or several names)."""
        return cls.registry.register(name, force)
