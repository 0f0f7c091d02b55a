"""Configuration: defaults, TOML file, DISPENSER_* environment, and redaction of secrets."""

from __future__ import annotations

from pathlib import Path

import pytest

from dispenser.config import ConfigError, load_config, redact


def test_defaults_without_file_or_environment() -> None:
    """With nothing set, the defaults are Leaf's and the limits the issue's."""
    config = load_config(environ={})
    assert config.segment.prefetch_threshold == 0.0
    assert config.segment.refresh_interval == 60.0
    assert (config.limits.max_ids, config.limits.max_ranges, config.limits.dedup_ttl) == (
        10_000,
        1_000_000,
        60,
    )
    assert config.nats.queue_group == "leaf"
    assert (config.segment.fetch_deadline, config.snowflake.wait_deadline) == (2.0, 2.0)


def test_environment_overrides_file(tmp_path: Path) -> None:
    """The environment wins over the file, and strings convert to the setting's type."""
    path = tmp_path / "dispenser.toml"
    path.write_text('[nats]\nurl = "nats://file:4222"\n[segment]\nfetch_deadline = 1.5\n')
    config = load_config(
        path, environ={"DISPENSER_NATS_URL": "nats://env:4222", "DISPENSER_LIMITS_MAX_IDS": "5"}
    )
    assert config.nats.url == "nats://env:4222"
    assert config.segment.fetch_deadline == 1.5
    assert config.limits.max_ids == 5


def test_config_file_from_environment(tmp_path: Path) -> None:
    """DISPENSER_CONFIG names the file when --config is not given."""
    path = tmp_path / "c.toml"
    path.write_text('[postgres]\ndsn = "postgresql://db/leaf"\n')
    assert load_config(environ={"DISPENSER_CONFIG": str(path)}).postgres.dsn == "postgresql://db/leaf"


@pytest.mark.parametrize(
    ("text", "environ", "message"),
    [
        ("[nats]\nurl = 5\n", {}, "Expected `str`"),
        ("[nats]\nurll = 'x'\n", {}, r"\[nats\] urll: unknown setting"),
        ("not toml ===", {}, "not valid TOML"),
        ("", {"DISPENSER_SEGMENT_FETCH_DEADLINE": "soon"}, "Expected `float`"),
    ],
)
def test_bad_configuration_is_a_clear_error(
    tmp_path: Path, text: str, environ: dict[str, str], message: str
) -> None:
    """Wrong types, unknown settings and broken TOML are errors that say what is wrong."""
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path, environ=environ)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    """A config path that does not exist is named in the error."""
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.toml", environ={})


def test_redact_hides_passwords() -> None:
    """Passwords in URLs and DSN parameters are masked."""
    assert redact("postgresql://leaf:s3cret@db:5432/leaf") == "postgresql://leaf:***@db:5432/leaf"
    assert "tok" not in redact("nats://u:tok@host:4222")
    assert redact("host=db password=abc") == "host=db password=***"


def test_redact_hides_nats_tokens_but_not_dsn_users() -> None:
    """`nats://TOKEN@host` is a token (masked); `postgresql://user@host` is a user name (kept)."""
    assert redact("nats://s3cret@h:4222,tls://u:pw@h2:4222") == "nats://***@h:4222,tls://u:***@h2:4222"
    assert redact("postgresql://postgres@db:5432/leaf") == "postgresql://postgres@db:5432/leaf"


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"DISPENSER_LOG_LEVEL": "verbose"}, r"DISPENSER_LOG_LEVEL.*'verbose'.*log\.level"),
        ({"DISPENSER_RATE_INTERVAL": "0"}, r"DISPENSER_RATE_INTERVAL.*> 0.*rate\.interval"),
        ({"DISPENSER_RATE_HYSTERESIS": "2"}, r"<= 1.*rate\.hysteresis"),
        ({"DISPENSER_METRICS_PORT": "70000"}, r"<= 65535.*metrics\.port"),
        ({"DISPENSER_ENRICH_COMMIT_RECORDS": "0"}, r">= 1.*enrich\.commit_records"),
        ({"DISPENSER_SEGMENT_PREFETCH_THRESHOLD": "1.5"}, r"segment\.prefetch_threshold"),
    ],
)
def test_out_of_range_settings_name_the_setting(environ: dict[str, str], message: str) -> None:
    """Settings are checked against their ranges, and the error names the variable and the setting."""
    with pytest.raises(ConfigError, match=message):
        load_config(environ=environ)


def test_a_bad_setting_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dispenser` with a bad setting prints one line naming it and exits 2, no traceback."""
    from dispenser.cli import main  # noqa: PLC0415

    monkeypatch.setenv("DISPENSER_LOG_LEVEL", "verbose")
    assert main(["check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "DISPENSER_LOG_LEVEL" in err
    assert "Traceback" not in err
