"""Typed errors. A `UserError` is a mistake in the user's input: the CLI prints its
message as one line and exits with status 2, never a traceback."""

from __future__ import annotations


class MpressError(Exception):
    """Base class of every error mpress raises on purpose.

    Every subclass pickles whatever its `__init__` takes: the constructor's arguments are
    kept and replayed on unpickling (errors cross process boundaries in broadcasts and
    gathers, and `Exception`'s own pickling calls `cls(*self.args)`, i.e. with the
    formatted message only, which fails for a subclass such as `ConfigError`).
    """

    def __new__(cls, *args: object, **kwargs: object) -> "MpressError":
        self = super().__new__(cls, *args)
        self._init_args = (args, kwargs)
        return self

    def __reduce__(self) -> tuple:
        args, kwargs = self._init_args
        return (_rebuild, (type(self), args, kwargs), self.__dict__)


def _rebuild(cls: type[MpressError], args: tuple, kwargs: dict) -> MpressError:
    """Unpickling: the error built again from its constructor's arguments."""
    return cls(*args, **kwargs)


class UserError(MpressError):
    """Bad input from the user (config file, CLI flag, profile, plan)."""


class ConfigError(UserError):
    """A config file (or dict) has an unknown key, a wrong type or an out-of-range value.

    The message always names the source (file), the key and what is allowed.
    """

    def __init__(self, source: str, key: str, problem: str) -> None:
        self.source = source
        self.key = key
        self.problem = problem
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{key}: {problem}")


class ProfileError(UserError):
    """A profile does not match the model or stage it is used with."""


class ScheduleError(UserError):
    """A schedule or partition cannot be built for the requested stages/microbatches."""


class PlanError(UserError):
    """A plan does not match the model, hardware or stage it is used with."""


class TopologyError(UserError):
    """The hardware topology is inconsistent or does not match the detected one."""


class TilingError(UserError):
    """Fused-tiled execution cannot run as asked: an out-of-memory verdict (with the
    numbers), an operator that cannot be tiled, or a bad tiling option."""


class SwapError(MpressError):
    """A swap (host or peer) failed at run time; the message names the tensor."""


class DeviceOutOfMemory(MpressError):
    """A rank's live device bytes went over its device's capacity (the CPU stand-in's
    check; the message names the rank, its action and the largest residents)."""
