"""`dispenser decode`: a snowflake ID's fields with the configured layout and epoch."""

from __future__ import annotations

import pytest

from dispenser.cli import main
from dispenser.core.snowflake import SnowflakeLayout


def test_decode_prints_time_worker_and_sequence(capsys: pytest.CaptureFixture[str]) -> None:
    """An ID composed with the default layout decodes to its time, worker and sequence."""
    snowflake_id = SnowflakeLayout().compose(1_795_251_696_389, 7, 42)
    assert main(["decode", str(snowflake_id)]) == 0
    out = capsys.readouterr().out
    assert "2026-11-21T09:01:36.389Z" in out
    assert "worker:    7" in out
    assert "sequence:  42" in out


def test_decode_uses_the_configured_epoch(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With another epoch in the config, the same bits decode to another time (Leaf hard-codes it)."""
    monkeypatch.setenv("DISPENSER_SNOWFLAKE_EPOCH_MS", "0")
    assert main(["decode", str(1000 << 22)]) == 0
    assert "1970-01-01T00:00:01.000Z" in capsys.readouterr().out


def test_decode_refuses_a_negative_id(capsys: pytest.CaptureFixture[str]) -> None:
    """A number that no layout can produce is an error, exit status 1."""
    assert main(["decode", "-5"]) == 1
    assert "-5 is not an ID of this layout" in capsys.readouterr().err


def test_decode_shows_the_datacenter_with_datacenter_bits(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Twitter's 5 + 5 layout: the datacenter field is printed; Leaf's layout prints none."""
    snowflake_id = SnowflakeLayout(datacenter_bits=5, worker_bits=5).compose(1_795_251_696_389, 7, 42, 3)
    monkeypatch.setenv("DISPENSER_SNOWFLAKE_DATACENTER_BITS", "5")
    monkeypatch.setenv("DISPENSER_SNOWFLAKE_WORKER_BITS", "5")
    assert main(["decode", str(snowflake_id)]) == 0
    out = capsys.readouterr().out
    assert "datacenter: 3" in out
    assert "worker:    7" in out
    assert "2026-11-21T09:01:36.389Z" in out
    monkeypatch.delenv("DISPENSER_SNOWFLAKE_DATACENTER_BITS")
    monkeypatch.delenv("DISPENSER_SNOWFLAKE_WORKER_BITS")
    assert main(["decode", str(SnowflakeLayout().compose(1_795_251_696_389, 7, 42))]) == 0
    assert "datacenter" not in capsys.readouterr().out
