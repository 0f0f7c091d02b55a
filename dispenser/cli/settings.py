"""The ``dispenser config`` command: the effective settings, as TOML, secrets masked."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dispenser.cli.common import AddParser
from dispenser.config import Config, effective

__all__ = ["add_config", "run_config"]


def add_config(add_parser: AddParser) -> None:
    """``dispenser config``: no options of its own."""
    add_parser(
        "config",
        help="print the effective configuration (file, then DISPENSER_* variables) as TOML, secrets masked",
        description=(
            "Print the settings a command would run with: the defaults, overridden by the file (--config or "
            "DISPENSER_CONFIG), overridden by DISPENSER_* variables. Passwords, tokens and the password in "
            "a URL or DSN are masked; unset settings are left out."
        ),
    )


def run_config(_args: argparse.Namespace, config: Config) -> int:
    """Print the effective settings as TOML (``effective`` masks the secrets)."""
    import tomli_w  # noqa: PLC0415

    def present(values: dict[str, Any]) -> dict[str, Any]:  # TOML has no null: unset settings are left out
        return {name: value for name, value in values.items() if value is not None}

    sections = {section: present(values) for section, values in effective(config).items()}
    sys.stdout.write(tomli_w.dumps(sections))
    return 0
