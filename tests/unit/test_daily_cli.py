"""``dispenser tag add --daily``: its bad inputs are usage errors, refused before connecting to anything."""

from __future__ import annotations

import pytest

from dispenser import cli


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tag", "add", "x", "--step", "10", "--daily", "--width", "11"], "width must be between 1 and 10"),
        (["tag", "add", "x", "--step", "10", "--daily", "--time-zone", "Mars/Olympus"], "unknown time zone"),
        (["tag", "add", "x", "--step", "10", "--width", "6"], "add --daily"),
        (["tag", "add", "x", "--step", "10", "--time-zone", "UTC"], "add --daily"),
        (["tag", "add", "x", "--step", "10", "--daily", "--start", "5"], "takes no start"),
        (["tag", "add", "x", "--step", "10", "--daily", "--stride", "2", "--offset", "0"], "no stride"),
        (["tag", "add", "x" * 120, "--step", "10", "--daily"], "at most 119 characters"),
    ],
)
def test_a_bad_daily_tag_is_a_usage_error(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each mistake exits 2 naming what is wrong, without reaching PostgreSQL."""
    # Nothing listens here: reaching the connection would fail with another message.
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", "postgresql://nobody@127.0.0.1:9/none")
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tag", "set", "x"], "give --step, or a daily tag's --width or --time-zone"),
        (["tag", "set", "x", "--width", "11"], "width must be between 1 and 10"),
        (["tag", "set", "x", "--time-zone", "Nowhere/City"], "unknown time zone"),
    ],
)
def test_a_bad_tag_set_is_a_usage_error(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `tag set` with nothing to set, or a width or zone no daily tag can have: exit 2, before connecting."""
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", "postgresql://nobody@127.0.0.1:9/none")
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
