"""The suite-wide secret check can fail: planted secrets are found in log records, log files and a session."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import secret_scan
from tests.secret_scan import Leak, SecretScanHandler, find_secrets, scan_log_files

ROOT = Path(__file__).resolve().parents[2]
# Not in SECRETS: the session's own check must not see these as leaks.
PLANTED = {"planted": "planted-a91c07e5d3-value", "other": "other-5b2e8f1c44-value"}


@pytest.fixture
def planted_logger() -> Iterator[tuple[logging.Logger, SecretScanHandler]]:
    """A logger that does not propagate (the session's scanner never sees it) with a scanner of its own."""
    logger = logging.getLogger("tests.planted")
    handler = SecretScanHandler(PLANTED)
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    yield logger, handler
    logger.removeHandler(handler)
    logger.propagate = True


def test_find_secrets_names_every_secret_present() -> None:
    """find_secrets returns the names of the values in the text, and nothing for clean text."""
    assert find_secrets(f"a {PLANTED['other']} b {PLANTED['planted']}", PLANTED) == ["planted", "other"]
    assert find_secrets("nats://u:***@host", PLANTED) == []


def test_handler_finds_secrets_in_args_exceptions_and_extras(
    planted_logger: tuple[logging.Logger, SecretScanHandler],
) -> None:
    """A secret in a message argument, a traceback or an `extra` field is reported with logger and level."""
    logger, handler = planted_logger
    logger.debug("connecting to %s", "nothing secret")
    assert handler.leaks == []
    logger.debug("connecting to nats://u:%s@host", PLANTED["planted"])
    try:
        raise ValueError(PLANTED["other"])
    except ValueError:
        logger.exception("it failed")
    logger.error("no secret in the message", extra={"dsn": f"postgresql://u:{PLANTED['planted']}@h/db"})
    assert handler.leaks == [
        Leak("planted", "logger 'tests.planted' (DEBUG)"),
        Leak("other", "logger 'tests.planted' (ERROR)"),
        Leak("planted", "logger 'tests.planted' (ERROR)"),
    ]
    assert PLANTED["planted"] not in str(handler.leaks[0])  # the report names the secret, never shows it


def test_log_files_are_scanned_across_reads_and_binary_files_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A secret in a *.log file is found, even split across two reads; binary *.log and other files are not read."""
    monkeypatch.setattr(secret_scan, "_CHUNK", 64)
    secret = PLANTED["planted"]
    (tmp_path / "servers" / "nats").mkdir(parents=True)
    split = tmp_path / "servers" / "nats" / "nats-server.log"
    split.write_text("x" * (8192 + 64 - 5) + secret + "\n")  # crosses the first chunk's end
    (tmp_path / "clean.log").write_text("nothing to see\n" * 100)
    (tmp_path / "00000000000000000000.log").write_bytes(b"\0\0\0\0" + secret.encode())  # a Kafka segment
    (tmp_path / "notes.txt").write_text(secret)
    assert scan_log_files(tmp_path, PLANTED) == [Leak("planted", f"file {split}")]
    assert scan_log_files(tmp_path / "missing", PLANTED) == []


@pytest.mark.parametrize(
    "runner",
    [pytest.param(["-n", "0"], id="serial"), pytest.param(["-n", "2"], id="xdist")],
)
def test_a_leak_fails_the_session(tmp_path: Path, runner: list[str]) -> None:
    """A session whose test logs a secret, or writes one into a log file, exits non-zero and names both.

    Under pytest-xdist too: the test runs in a worker process, whose findings must reach the controller.
    """
    test_file = tmp_path / "test_leaky.py"
    test_file.write_text(
        textwrap.dedent(
            """
            import logging
            from pathlib import Path

            from tests.secret_values import SECRETS

            SECRETS["planted_in_session"] = "planted-in-session-3f9a0c71"

            def test_leaks(tmp_path: Path) -> None:
                logging.getLogger("leaky.module").info("password=%s", SECRETS["planted_in_session"])
                (tmp_path / "server.log").write_text("auth " + SECRETS["planted_in_session"])
            """
        )
    )
    inner = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            f"--rootdir={ROOT}",
            "-c",
            str(ROOT / "pyproject.toml"),
            f"--basetemp={tmp_path / 'inner'}",
            *runner,
            str(test_file),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"PYTHONDONTWRITEBYTECODE": "1"},
        check=False,
    )
    output = inner.stdout + inner.stderr
    assert inner.returncode == pytest.ExitCode.TESTS_FAILED, output
    assert "1 passed" in output
    assert "SECRET LEAKED: secret 'planted_in_session' found in logger 'leaky.module' (INFO)" in output
    assert "SECRET LEAKED: secret 'planted_in_session' found in file " in output
    assert "planted-in-session-3f9a0c71" not in output
