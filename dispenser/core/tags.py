"""Tag names: what a valid business tag looks like (``[A-Za-z0-9_.-]{1,128}``)."""

from __future__ import annotations

import re

from dispenser.core.errors import InvalidTag

__all__ = ["TAG_PATTERN", "validate_tag"]

TAG_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def validate_tag(tag: str) -> str:
    """Return ``tag`` if it is a valid tag name, else raise :class:`InvalidTag`."""
    if TAG_PATTERN.fullmatch(tag) is None:
        raise InvalidTag(tag)
    return tag
