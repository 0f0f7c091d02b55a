"""Plain-text tables and number formats, for every command that prints one (``bench``, ``watch``, the soak)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["fmt_ms", "fmt_rate", "fmt_ratio", "fmt_us", "render_table"]


def render_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    table = [list(headers), *(list(row) for row in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        cells = [
            row[0].ljust(widths[0]),
            *(cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)),
        ]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(table[0]), rule, *(line(row) for row in table[1:])])


def fmt_rate(value: float | None) -> str:
    """A rate with thousands separators (``-`` if missing)."""
    return "-" if value is None else f"{value:,.0f}"


def fmt_ms(value: float | None) -> str:
    """Milliseconds to 2 decimals (``-`` if missing)."""
    return "-" if value is None else f"{value:.2f}"


def fmt_us(value: float | None) -> str:
    """Microseconds to 1 decimal (``-`` if missing)."""
    return "-" if value is None else f"{value:.1f}"


def fmt_ratio(value: float | None, percent: bool = False) -> str:
    """A ratio as ``0.87`` or ``87%`` (``-`` if missing)."""
    if value is None:
        return "-"
    return f"{value:.0%}" if percent else f"{value:.2f}"
