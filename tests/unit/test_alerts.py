"""docs/alerts.yml: valid rules (promtool), their unit tests pass, and real scrapes of a worker fire them.

promtool comes from Debian's ``prometheus`` package: scripts/test extracts the one binary into
``~/.cache/leaf-dispenser/promtool/`` (see ``install_promtool`` there); ``PROMTOOL=/path`` or a ``promtool``
on the PATH does too. Without it these tests fail, never skip.

The last test builds a worker from the real services on virtual time (segment allocator, dispatcher,
snowflake generator), drives it into each condition an operator must hear about, scrapes its /metrics once a
virtual minute, and hands the scrapes to ``promtool test rules`` as input series: the rules are checked
against what the worker really exposes, names, labels and values, not against series written by hand.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import shutil
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from dispenser.core.snowflake import SnowflakeLayout
from dispenser.messages import IdRequest
from dispenser.ports import WorkerLease
from dispenser.service.dispatch import Dispatcher, Limits
from dispenser.service.segments import AllocatorSettings, SegmentAllocator
from dispenser.service.snowflake import SnowflakeGenerator, SnowflakeSettings
from dispenser.testing.clock import settle
from dispenser.testing.fakes import MemorySegmentStore
from tests.unit.metrics_support import (
    FakeKafka,
    FakeWorker,
    LosableRegistry,
    Samples,
    SteppedClock,
    rate_book,
    scrape,
)

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "docs" / "alerts.yml"
UNIT_TESTS = Path(__file__).with_name("alerts.test.yml")
LAYOUT = SnowflakeLayout()
LABELS = {"job": "leaf-dispenser", "instance": "w1"}


def _promtool() -> str:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "leaf-dispenser" / "promtool"
    for candidate in (os.environ.get("PROMTOOL"), str(cache / "promtool"), shutil.which("promtool")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail(
        "promtool not found: scripts/test installs it into ~/.cache/leaf-dispenser/promtool/ (from Debian's "
        "prometheus package); or set PROMTOOL=/path/to/promtool"
    )


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_promtool(), *args], capture_output=True, text=True, timeout=60, check=False)


def _rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [rule for group in document["groups"] for rule in group["rules"]]


# ---------------------------------------------------------------------------------------------------------


def test_rules_are_valid() -> None:
    """`promtool check rules docs/alerts.yml` passes (syntax, PromQL, templates)."""
    result = _run("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


def test_rules_pass_their_unit_tests() -> None:
    """`promtool test rules tests/unit/alerts.test.yml`: each alert fires when it should, with its text."""
    result = _run("test", "rules", str(UNIT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    tested = set(re.findall(r"alertname: (\w+)", UNIT_TESTS.read_text(encoding="utf-8")))
    assert tested == {rule["alert"] for rule in _rules()}, "every alert has a unit test"


def test_the_unit_tests_have_teeth(tmp_path: Path) -> None:
    """A rule with another threshold or a misspelt metric fails the unit tests."""
    rules = RULES.read_text(encoding="utf-8")
    for old, new in [
        ("leaf_runway_seconds < 300", "leaf_runway_seconds < 200"),
        ("leaf_snowflake_lease_held == 0", "leaf_snowflake_lease_hold == 0"),
    ]:
        assert old in rules
        (tmp_path / "alerts.yml").write_text(rules.replace(old, new), encoding="utf-8")
        tests = UNIT_TESTS.read_text(encoding="utf-8").replace("../../docs/alerts.yml", "alerts.yml")
        (tmp_path / "alerts.test.yml").write_text(tests, encoding="utf-8")
        result = _run("test", "rules", str(tmp_path / "alerts.test.yml"))
        assert result.returncode != 0, f"{new}: the unit tests still pass"


# ---------------------------------------------------------------------------------------------------------
# real scrapes


@dataclass
class Rig:
    """One worker (segments of tag ``order``, snowflakes, Kafka counters) on a manual clock."""

    clock: SteppedClock
    store: MemorySegmentStore
    registry: LosableRegistry
    allocator: SegmentAllocator
    snowflake: SnowflakeGenerator
    worker: FakeWorker
    segments: Dispatcher
    snowflakes: Dispatcher
    step: int
    scrapes: list[Samples] = field(default_factory=list)

    @classmethod
    def build(cls, step: int) -> Rig:
        clock = SteppedClock()
        store = MemorySegmentStore()
        rates = rate_book(clock)
        allocator = SegmentAllocator(
            store,
            clock,
            AllocatorSettings(retry_initial=0.5, retry_max=2.0),
            meters=rates.segment_meter,
        )
        registry = LosableRegistry(5, max_worker_id=LAYOUT.max_worker_id)
        snowflake = SnowflakeGenerator(
            LAYOUT,
            WorkerLease(5, 0),
            registry,
            clock,
            _no_persist,
            settings=SnowflakeSettings(report_interval=3600),
        )
        limits = Limits(deadline=1.0)
        segments = Dispatcher(allocator, clock, limits, kind="segment")
        snowflakes = Dispatcher(snowflake, clock, limits, kind="snowflake")
        worker = FakeWorker(
            clock, rates, allocator, snowflake, FakeKafka(), {"segment": segments, "snowflake": snowflakes}
        )
        return cls(clock, store, registry, allocator, snowflake, worker, segments, snowflakes, step)

    async def start(self) -> None:
        await self.store.add_tag("order", self.step)
        await self.allocator.refresh()
        await self.registry.register()
        await self.snowflake.start()

    async def stop(self) -> None:
        await self.snowflake.stop()
        await self.allocator.close()

    async def minutes(self, count: int, each_second: Callable[[], None] | None = None) -> None:
        """Scrape, then serve 10 segment IDs and one snowflake ID a second for a minute; ``count`` times."""
        pending: set[asyncio.Future[Any]] = set()
        for _ in range(count):
            self.scrapes.append(scrape(self.worker))
            for _ in range(60):
                if each_second is not None:
                    each_second()
                for dispatcher, request in ((self.segments, IdRequest(10)), (self.snowflakes, IdRequest(1))):
                    pending.add(asyncio.ensure_future(dispatcher.answer("order", request)))
                await self.clock.advance(1.0)
                pending = {future for future in pending if not future.done()}
        await self.clock.run_until(lambda: all(future.done() for future in pending))

    def input_series(self) -> list[dict[str, str]]:
        """The scrapes as promtool input series, one sample a minute ('_' where a series was missing)."""
        keys = sorted({key for samples in self.scrapes for key in samples})
        series = [
            {"series": 'up{job="leaf-dispenser", instance="w1"}', "values": f"1x{len(self.scrapes) - 1}"}
        ]
        for name, labels in keys:
            if name.endswith(("_bucket", "_created")):
                continue
            selector = ", ".join(
                f'{key}="{value}"' for key, value in sorted({**LABELS, **dict(labels)}.items())
            )
            values = [_value(samples.get((name, labels))) for samples in self.scrapes]
            series.append({"series": f"{name}{{{selector}}}", "values": " ".join(values)})
        return series


def _value(value: float | None) -> str:
    if value is None:
        return "_"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


async def _no_persist(_worker_id: int, _high_water_ms: int) -> None:
    return None


def _firing_test(name: str, rig: Rig, expected: dict[str, set[str]]) -> dict[str, Any]:
    """A promtool test: at each eval time (minutes), exactly the alerts named are firing."""
    return {
        "name": name,
        "interval": "1m",
        "input_series": rig.input_series(),
        "promql_expr_test": [
            {
                "expr": 'count by (alertname) (ALERTS{alertstate="firing"})',
                "eval_time": when,
                "exp_samples": [
                    {"labels": f'{{alertname="{alert}"}}', "value": 1} for alert in sorted(alerts)
                ],
            }
            for when, alerts in expected.items()
        ],
    }


Scenario = Callable[[Rig], Awaitable[None]]


async def _healthy(rig: Rig) -> None:
    await rig.minutes(12)


async def _database_down(rig: Rig) -> None:
    await rig.minutes(1)
    rig.store.set_unavailable()  # the buffers (2 segments of 1,000 IDs at 10 IDs/s) last about 3 minutes
    await rig.minutes(9)


async def _clock_steps_back(rig: Rig) -> None:
    await rig.minutes(2)
    # Requests come once a second: a step of 1,003 ms puts the clock 3 ms behind the last ID (waited out),
    rig.clock.wall_step_ms -= 1_003
    await rig.minutes(2)
    rig.clock.wall_step_ms -= 2_000  # and one of 2 s a second behind it: refused until the clock catches up
    await rig.minutes(2)


async def _lease_lost(rig: Rig) -> None:
    await rig.minutes(2)
    rig.registry.held = False
    await rig.minutes(3)
    rig.registry.held = True
    await rig.minutes(3)


SCENARIOS: list[tuple[str, int, Scenario, dict[str, set[str]]]] = [
    ("a healthy worker raises nothing", 100_000, _healthy, {"11m": set()}),
    (
        "PostgreSQL down: fetches fail, the runway runs out, then requests fail",
        1_000,
        _database_down,
        {
            "1m": set(),
            "9m": {"LeafSegmentFetchesFailing", "LeafRunwayCritical", "LeafIdErrors"},
        },
    ),
    (
        "the clock steps back a little, then a lot",
        100_000,
        _clock_steps_back,
        {
            "1m": set(),
            "3m": {"LeafSnowflakeClockSteppedBack"},
            "5m": {"LeafSnowflakeClockSteppedBack", "LeafSnowflakeClockMovedBackwards"},
        },
    ),
    (
        "the snowflake lease is lost, then regained",
        100_000,
        _lease_lost,
        {"1m": set(), "4m": {"LeafSnowflakeLeaseLost"}, "7m": set()},
    ),
]


async def _run_scenarios() -> list[tuple[str, Rig, dict[str, set[str]]]]:
    runs = []
    for name, step, scenario, expected in SCENARIOS:
        rig = Rig.build(step)
        await rig.start()
        try:
            await scenario(rig)
        finally:
            await rig.stop()
            await settle()
        runs.append((name, rig, expected))
    return runs


@pytest.fixture(scope="module")
def scenario_runs() -> list[tuple[str, Rig, dict[str, set[str]]]]:
    """Every scenario, run once for the module (virtual time: well under a second each)."""
    return asyncio.run(_run_scenarios())


def test_rules_name_only_metrics_a_worker_exposes(
    scenario_runs: list[tuple[str, Rig, dict[str, set[str]]]],
) -> None:
    """Every leaf_* metric a rule reads shows in the scrapes of a real worker (segments, snowflakes, Kafka)."""
    exposed = {name for _, rig, _ in scenario_runs for samples in rig.scrapes for name, _ in samples}
    used = {name for rule in _rules() for name in re.findall(r"\bleaf_\w+", rule["expr"])}
    assert len(used) >= 8
    assert sorted(used - exposed) == []


def test_real_scrapes_fire_the_alerts(
    scenario_runs: list[tuple[str, Rig, dict[str, set[str]]]], tmp_path: Path
) -> None:
    """A worker driven into each condition, scraped every virtual minute, fires exactly the expected alerts."""
    tests = [_firing_test(name, rig, expected) for name, rig, expected in scenario_runs]
    (tmp_path / "alerts.yml").write_text(RULES.read_text(encoding="utf-8"), encoding="utf-8")
    document = {"rule_files": ["alerts.yml"], "evaluation_interval": "1m", "tests": tests}
    test_file = tmp_path / "scrapes.test.yml"
    test_file.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    result = _run("test", "rules", str(test_file))
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_every_alert_has_a_runbook_url_into_the_runbook() -> None:
    """Each alert's runbook_url is docs/runbook.md#<its name>, and the runbook has that section."""
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    runbook = ROOT / "docs" / "runbook.md"
    sections = {
        line[3:].strip().lower() for line in runbook.read_text().splitlines() if line.startswith("## ")
    }
    alerts = [rule["alert"] for rule in rules if "alert" in rule]
    assert len(alerts) >= 11
    for rule in rules:
        name = rule["alert"]
        assert rule["annotations"]["runbook_url"] == f"docs/runbook.md#{name.lower()}", name
        assert name.lower() in sections, f"docs/runbook.md has no section '## {name}'"
