"""Every typed error survives pickling (ranks broadcast and gather them): each subclass
of `MpressError` in any mpress module, found by walking the class tree, so a new error
class is covered without editing this test."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import pytest

import mpress
from mpress.errors import MpressError

_SKIP_MODULES = {"mpress.__main__"}  # runs the CLI on import


def _import_all() -> None:
    for info in pkgutil.walk_packages(mpress.__path__, "mpress."):
        if info.name not in _SKIP_MODULES:
            importlib.import_module(info.name)


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


_import_all()
ERRORS = sorted({MpressError, *_subclasses(MpressError)}, key=lambda c: f"{c.__module__}.{c.__qualname__}")


def _instance(cls: type[MpressError]) -> MpressError:
    """`cls` built with a distinct string for every parameter its constructor requires."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    args, kwargs = [], {}
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            args.append(f"<{cls.__name__} message>")
        elif p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            args.append(f"<{p.name}>")
        elif p.default is p.empty and p.kind is p.KEYWORD_ONLY:
            kwargs[p.name] = f"<{p.name}>"
    return cls(*args, **kwargs)


def test_the_walk_finds_the_known_errors() -> None:
    names = {c.__name__ for c in ERRORS}
    assert {"UserError", "ConfigError", "PlanError", "SwapError", "DeviceOutOfMemory"} <= names


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_error_round_trips_through_pickle(cls: type[MpressError]) -> None:
    error = _instance(cls)
    error.note = "an attribute set after construction"
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls
    assert str(back) == str(error) and back.args == error.args
    assert {k: v for k, v in vars(back).items()} == {k: v for k, v in vars(error).items()}
