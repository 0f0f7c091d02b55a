"""The worker's settings read from their config sections by field name (dispenser.app.parts.settings_of)."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from dispenser.app.parts import Off, PartOff, present, settings_of
from dispenser.app.rates import rate_book
from dispenser.config import Config, LimitsConfig, RateConfig, SegmentConfig, SnowflakeConfig
from dispenser.core.step import StepPolicy
from dispenser.service.dispatch import Limits
from dispenser.service.rates import RateSettings
from dispenser.service.segments import AllocatorSettings
from dispenser.service.snowflake import SnowflakeSettings
from dispenser.testing import ManualClock

# (settings, the config section they are read from, their fields set otherwise: an override or the default)
READ = [
    (RateSettings, RateConfig, set()),
    (StepPolicy, RateConfig, set()),
    (Limits, LimitsConfig, {"deadline"}),  # segment.fetch_deadline, or snowflake.wait_deadline
    (AllocatorSettings, SegmentConfig, {"retry_initial", "unknown_tag_refresh_interval"}),
    (SnowflakeSettings, SnowflakeConfig, {"registry_outage"}),  # the registration's
]


@pytest.mark.parametrize(("kind", "section", "elsewhere"), READ, ids=[kind.__name__ for kind, *_ in READ])
def test_every_settings_field_has_a_config_field_of_its_name(
    kind: type[object], section: type[msgspec.Struct], elsewhere: set[str]
) -> None:
    """A field renamed on one side only would silently keep its default: each is either read or listed here."""
    fields = {field.name for field in dataclasses.fields(kind)}  # type: ignore[arg-type]
    assert fields - set(section.__struct_fields__) == elsewhere


def test_the_config_values_reach_the_settings_and_overrides_win() -> None:
    """Values that are not the defaults are the ones the settings get; an override replaces its field."""
    limits = settings_of(Limits, LimitsConfig(max_ids=7, max_ranges=3, max_body_bytes=100), deadline=0.5)
    assert limits == Limits(max_ids=7, max_ranges=3, max_body_bytes=100, deadline=0.5)
    config = Config(rate=RateConfig(interval=0.7, window=9, adaptive_step=False, max_step=11, hysteresis=0.5))
    book = rate_book(config, ManualClock())
    assert (book.settings.interval, book.settings.window, book.settings.adaptive_step) == (0.7, 9, False)
    assert book.policy == StepPolicy(segment_seconds=600.0, max_step=11, hysteresis=0.5)


def test_a_part_left_off_names_its_setting() -> None:
    """present() returns a part that is on, and raises PartOff naming the setting for one that is off."""
    assert present(3, "number") == 3
    with pytest.raises(PartOff, match=r"^this worker runs no HTTP API \(see http\.port\)$") as raised:
        present(Off("http.port"), "HTTP API")
    assert raised.value.setting == "http.port"
