"""Every runner backend implements the whole RunnerHandle protocol the scheduler is typed
against: every method (async where the protocol's is) and every attribute."""

from __future__ import annotations

import inspect
import typing

import pytest

from scheduler.runners.interface import RunnerHandle
from scheduler.runners.local import LocalRunner
from scheduler.runners.process_runner import ProcessRunner
from scheduler.runners.ray_runner import RayRunner


def members():
    methods = {
        name: inspect.iscoroutinefunction(fn)
        for name, fn in vars(RunnerHandle).items()
        if callable(fn) and not name.startswith("_")
    }
    return methods, set(typing.get_type_hints(RunnerHandle))


def assigned(cls) -> set[str]:
    """Attributes a class sets: class attributes, properties, `self.x = ...` in __init__
    (and in _init_streams, where the backends with an engine process keep their streams)."""
    source = inspect.getsource(cls.__init__)
    if hasattr(cls, "_init_streams"):
        source += inspect.getsource(cls._init_streams)
    names = {
        line.split("self.", 1)[1].split(" ")[0].split(":")[0]
        for line in source.splitlines()
        if line.strip().startswith("self.")
    }
    return names | {n for k in cls.__mro__ for n in vars(k) if not n.startswith("__")}


@pytest.mark.parametrize("cls", [LocalRunner, ProcessRunner, RayRunner])
def test_the_backend_implements_every_member(cls):
    methods, attributes = members()
    assert {"open", "take", "register_adapter", "validate", "stop_lending"} <= set(methods)
    for name, is_async in methods.items():
        fn = getattr(cls, name, None)
        assert fn is not None, f"{cls.__name__} lacks {name}()"
        assert inspect.iscoroutinefunction(fn) == is_async, f"{cls.__name__}.{name}: async?"
    missing = attributes - assigned(cls)
    assert not missing, f"{cls.__name__} lacks {sorted(missing)}"
