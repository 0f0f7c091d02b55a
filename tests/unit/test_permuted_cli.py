"""``dispenser tag set --permuted|--no-permuted``: its bad inputs are usage errors, refused before connecting."""

from __future__ import annotations

import pytest

from dispenser import cli


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tag", "set", "x", "--permuted", "--no-permuted"], "not both"),
        (["tag", "set", "x", "--permuted", "--ordered"], "goes not with --ordered"),
        (["tag", "set", "x", "--permuted", "--width", "6"], "a daily tag is never permuted"),
        (["tag", "set", "x"], "or --permuted or --no-permuted"),
    ],
)
def test_a_bad_tag_set_permuted_is_a_usage_error(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each mistake exits 2 naming what is wrong, without reaching PostgreSQL."""
    # Nothing listens here: reaching the connection would fail with another message.
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", "postgresql://nobody@127.0.0.1:9/none")
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
