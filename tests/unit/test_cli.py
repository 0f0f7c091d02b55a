"""The command line explains itself: options anywhere, help on everything, errors before connecting, typos named."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

from dispenser import cli
from dispenser.config import ConfigError, effective, load_config, unknown_variables


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subparsers here, and nowhere public
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _every_command() -> list[tuple[str, argparse.ArgumentParser]]:
    found = []
    for name, parser in _subparsers(cli._parser()).items():
        found.append((name, parser))
        found.extend((f"{name} {sub}", subparser) for sub, subparser in _subparsers(parser).items())
    return found


@pytest.mark.parametrize(("name", "parser"), _every_command(), ids=[name for name, _ in _every_command()])
def test_every_command_and_option_has_help(name: str, parser: argparse.ArgumentParser) -> None:
    top = _subparsers(cli._parser())
    if " " not in name:
        assert top[name].description or name in {"dev", "watch", "bench", "decode", "schemas"}, name
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        assert action.help, (
            f"`dispenser {name}`: {'/'.join(action.option_strings) or action.dest} has no help"
        )


def test_global_options_after_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "x.toml"
    config.write_text('[nats]\nsubject_prefix = "after"\n')
    assert cli.main(["config", "-c", str(config), "-v"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["nats"]["subject_prefix"] == "after"
    # Before the command, as before; and the later one wins when both are given.
    assert cli.main(["-c", str(config), "config"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["nats"]["subject_prefix"] == "after"
    other = tmp_path / "y.toml"
    other.write_text('[nats]\nsubject_prefix = "later"\n')
    assert cli.main(["-c", str(config), "config", "-c", str(other)]) == 0
    assert tomllib.loads(capsys.readouterr().out)["nats"]["subject_prefix"] == "later"


def test_config_file_errors_name_the_file_and_the_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[nats]\nurll = "nats://x"\n')
    with pytest.raises(
        ConfigError, match=r"bad\.toml: \[nats\] urll: unknown setting \(did you mean 'url'\?\)"
    ):
        load_config(path, environ={})
    path.write_text("[natz]\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: \[natz\]: unknown section \(did you mean 'nats'\?\)"):
        load_config(path, environ={})
    path.write_text('[postgres]\ncommand_timeout = "soon"\n')
    with pytest.raises(
        ConfigError, match=r"bad\.toml: \[postgres\] command_timeout: Expected `float`, got `str`"
    ):
        load_config(path, environ={})


def test_an_unknown_variable_is_named_with_a_suggestion() -> None:
    lines = unknown_variables(
        {"DISPENSER_NATS_URLS": "x", "DISPENSER_NATS_URL": "y", "DISPENSER_CONFIG": "z"}
    )
    assert lines == ["DISPENSER_NATS_URLS is not a setting and is ignored (did you mean DISPENSER_NATS_URL?)"]
    assert unknown_variables({"DISPENSER_WHATEVER": "1", "HOME": "/"}) == [
        "DISPENSER_WHATEVER is not a setting and is ignored"
    ]


def test_the_cli_warns_of_an_unknown_variable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DISPENSER_POSTGRES_DNS", "postgresql://x")
    assert cli.main(["config"]) == 0
    capsys.readouterr()
    assert (
        "DISPENSER_POSTGRES_DNS is not a setting and is ignored (did you mean DISPENSER_POSTGRES_DSN?)"
        in (caplog.text)
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tag", "add", "x", "--step", "0"], "--step: must be at least 1, got 0"),
        (["tag", "add", "x", "--step", "10", "--start", "-5"], "--start: must be at least 1, got -5"),
        (["tag", "set", "x", "--step", "ten"], "--step: not a whole number: 'ten'"),
        (["get", "x", "--kind", "snowflak"], "invalid choice: 'snowflak'"),
        (["get", "x", "--timeout", "0"], "--timeout: must be above 0"),
        (["get", "x", "0"], "count: must be at least 1"),
    ],
)
def test_arguments_are_checked_before_connecting(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["tag", "add", "bad tag!", "--step", "10"],
        ["get", "bad tag!"],
        ["tag", "add", "x", "--step", "3000000000"],
    ],
)
def test_values_the_server_would_refuse_are_refused_here(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Nothing listens here: reaching the connection would fail with another message.
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", "postgresql://nobody@127.0.0.1:9/none")
    monkeypatch.setenv("DISPENSER_NATS_URL", "nats://127.0.0.1:9")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "is not valid" in err or "step must be between" in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tag", "add", "x", "--step", "10", "--stride", "2"], "--offset is required with --stride 2"),
        (["tag", "add", "x", "--step", "10", "--stride", "2", "--offset", "2"], "offset must be between"),
        (["tag", "add", "x", "--step", "10", "--offset", "1"], "offset must be between"),
    ],
)
def test_a_stride_needs_an_explicit_offset(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--stride 2`` alone would take offset 0 in every datacenter (every ID twice): refused, naming --offset."""
    # Nothing listens here: reaching the connection would fail with another message.
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", "postgresql://nobody@127.0.0.1:9/none")
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_config_prints_the_effective_settings_with_secrets_masked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", "postgresql://leaf:hunter2@db:5432/leaf")
    monkeypatch.setenv("DISPENSER_NATS_PASSWORD", "s3cret-nats")
    monkeypatch.setenv("DISPENSER_KAFKA_SASL_PASSWORD", "s3cret-kafka")
    assert cli.main(["config"]) == 0
    out = capsys.readouterr().out
    for secret in ("hunter2", "s3cret-nats", "s3cret-kafka"):
        assert secret not in out
    printed = tomllib.loads(out)
    assert printed["postgres"]["dsn"] == "postgresql://leaf:***@db:5432/leaf"
    assert printed["nats"]["password"] == "***"
    # What it prints is a configuration the dispenser reads back (secrets aside).
    assert set(printed) == set(effective(load_config(environ={})))


def test_a_second_terminal_finds_the_dev_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DISPENSER_CONFIG", raising=False)
    (tmp_path / ".dispenser").mkdir()
    (tmp_path / ".dispenser" / "dev.toml").write_text('[nats]\nurl = "nats://127.0.0.1:14222"\n')
    assert cli.main(["config"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["nats"]["url"] == "nats://127.0.0.1:14222"
    # serve never picks it up by itself: a worker runs with the settings it was given.
    args = cli._parser().parse_args(["serve"])
    assert cli._config_path(args) is None
    # --config wins.
    (tmp_path / "mine.toml").write_text('[nats]\nurl = "nats://127.0.0.1:4444"\n')
    assert cli.main(["config", "-c", "mine.toml"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["nats"]["url"] == "nats://127.0.0.1:4444"
