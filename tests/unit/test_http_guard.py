"""The HTTP guard's pure parts: the connection cap under the file limit, the log limiter, the file limit."""

from __future__ import annotations

import logging
import resource
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from dispenser.adapters.http.guard import FD_RESERVE, LogLimiter, fit_connections, raise_open_files_limit


def test_the_cap_leaves_the_reserve_under_the_file_limit() -> None:
    """4,096 under a 1,024 limit: 768; never below one; a limit with room keeps the setting."""
    assert fit_connections(4096, 1024) == 1024 - FD_RESERVE
    assert fit_connections(4096, 100) == 1
    assert fit_connections(4096, 1 << 20) == 4096


def test_the_log_limiter_writes_a_line_a_second_and_counts_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    """Ten events in one second: one line; the next second's line says nine were left out."""
    now = [0.0]
    limiter = LogLimiter(logging.getLogger("test.limiter"), interval=1.0, clock=lambda: now[0])
    caplog.set_level(logging.INFO, "test.limiter")
    for i in range(10):
        now[0] = i * 0.1
        limiter.log(logging.INFO, "bad request %d", i)
    now[0] = 1.5
    limiter.log(logging.INFO, "bad request %d", 10)
    assert [r.getMessage() for r in caplog.records] == [
        "bad request 0",
        "bad request 10 (and 9 more like it since the last line)",
    ]


def test_the_open_files_limit_is_raised_to_the_hard_limit() -> None:
    """A soft limit below the hard one is raised to it (and restored here afterwards)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        assert raise_open_files_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == (
            hard if hard != resource.RLIM_INFINITY else 1 << 20
        )
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_aiohttp_is_required_past_its_request_smuggling_fixes() -> None:
    """pyproject.toml's floor for aiohttp excludes every release before 3.13.3 (smuggling fixes missing)."""
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["optional-dependencies"]["server"]]
    (aiohttp,) = [r for r in requirements if r.name == "aiohttp"]
    assert "3.13.2" not in aiohttp.specifier
    assert "3.12.14" not in aiohttp.specifier
    assert "3.13.3" in aiohttp.specifier
