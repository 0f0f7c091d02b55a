"""What the worker's parts share: a part the configuration leaves off, and settings read from the config.

A started worker's parts all exist: each is its object, or an :class:`Off` that names the setting which
would turn it on (never ``None``, so no reader guesses whether "absent" means "off" or "not yet").
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, TypeVar

import msgspec

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["Off", "PartOff", "present", "settings_of", "unless_off"]

T = TypeVar("T")
S = TypeVar("S", bound="DataclassInstance")


@dataclasses.dataclass(frozen=True, slots=True)
class Off:
    """A part this worker does not run, and why."""

    setting: str
    """The setting that leaves it off (``segment.enabled``, ``http.port``; ``serve`` for the serving parts of
    ``dispenser enrich``, which serves no requests)."""


class PartOff(LookupError):
    """Raised when a started worker is asked for a part that its configuration leaves off."""

    def __init__(self, part: str, off: Off) -> None:
        super().__init__(f"this worker runs no {part} (see {off.setting})")
        self.part = part
        self.setting = off.setting


def present(part: T | Off, name: str) -> T:
    """``part`` itself; :class:`PartOff` (naming ``name`` and the setting) if it is off."""
    if isinstance(part, Off):
        raise PartOff(name, part)
    return part


def unless_off(part: T | Off) -> T | None:
    """``part``, or ``None`` if it is off: for the readers that take either (the probes, ``/metrics``)."""
    return None if isinstance(part, Off) else part


def settings_of(kind: type[S], section: msgspec.Struct, **overrides: object) -> S:
    """``kind`` (a dataclass of settings) from the fields of a config ``section`` that bear its fields' names.

    The fields the section does not have keep their defaults, then ``overrides`` replace theirs
    (``tests/unit/test_app_settings.py`` says which are which, so that a renamed field cannot go unread).
    """
    settings = msgspec.convert(section, kind, from_attributes=True)
    return dataclasses.replace(settings, **overrides) if overrides else settings
