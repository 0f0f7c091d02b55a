"""What ``dispenser bench nats`` is asked to do: its options, the request bodies, the plan of each mode.

Nothing here starts a process or opens a connection: :func:`parse_options` turns a command line into
:class:`BenchOptions` (the docs' command lines are checked with it), :func:`plan_for_mode` turns those
into a :class:`ModePlan` (the tags to create and the worker's settings).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

from dispenser.arguments import positive_float, positive_int
from dispenser_lab.bench.deployment import add_target_options, deployment_of
from dispenser_lab.bench.errors import BenchError

__all__ = [
    "STATE_DIR_IN_WORKDIR",
    "STEADY_START",
    "SWITCH_START",
    "THROUGHPUT_BODIES",
    "BenchError",
    "BenchOptions",
    "Body",
    "Format",
    "ModePlan",
    "parse_options",
    "plan_for_mode",
]

Format = Literal["ids", "ranges"]

STEADY_START = 10**12
"""First ID of the large-step tag: every reply of a run carries IDs of the same width (13 digits), as a
tag in service for a while would, rather than growing from 1 digit as the run goes on."""
SWITCH_START = 1
"""First ID of the switch-over tag; segments are ``[start + k * step, start + (k + 1) * step - 1]``."""


@dataclass(frozen=True, slots=True)
class Body:
    """A request body: how many IDs, in which format."""

    format: Format
    count: int

    @property
    def label(self) -> str:
        """``ids/100``, ``ranges/10000``."""
        return f"{self.format}/{self.count}"

    def encode(self) -> bytes:
        """The JSON request body, as a client would send it."""
        if self.format == "ids":
            return msgspec.json.encode({"count": self.count})
        return msgspec.json.encode({"count": self.count, "format": self.format})


THROUGHPUT_BODIES = (Body("ids", 1), Body("ids", 100), Body("ranges", 10_000))


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchOptions:
    """Everything ``dispenser bench nats`` can be told (see :func:`parse_options` for the meanings)."""

    mode: str = "segment"
    duration: float = 3.0
    warmup: float = 0.5
    repeat: int = 1
    inflight: tuple[int, ...] = (1, 64)
    step: int = 1_000_000_000
    switch_step: int = 1_000
    switch_count: int = 10
    min_switches: int = 1000
    switch_max_time: float = 60.0
    timeout: float = 5.0
    nats_url: str | None = None
    postgres_dsn: str | None = None
    subject_prefix: str = "leaf"
    local: bool = False
    """Start NATS, PostgreSQL and a worker here: the default, also without the flag."""
    tag: str | None = None
    """Measure the deployment at ``nats_url`` on this existing tag (nothing started)."""
    create_tag: str | None = None
    """Measure the deployment at ``nats_url`` on this tag, added to ``postgres_dsn`` and removed after."""
    json_path: Path | None = None
    profile_worker: Path | None = None
    worker_command: str | None = None
    request_id: bool = False
    daily: bool = False
    permuted: bool = False
    strict: bool = False
    quiet: bool = False
    processes: int = 1
    """Also measure ``dispenser serve --processes N`` against the one worker (1: not)."""


@dataclass(frozen=True, slots=True)
class ModePlan:
    """How the dispenser is set up and asked in one mode."""

    mode: str
    kind: str
    """The subject part: requests go to ``<prefix>.<kind>.<tag>``."""
    steady_tag: str
    steady_step: int | None
    switch_tag: str | None
    """Tag with a small step for the switch-over cases; ``None`` when the mode has no segments."""
    switch_step: int | None
    tags: list[tuple[str, int, int]] = field(default_factory=list)
    """Segment tags ``(name, step, first ID)`` to create before the worker starts (and remove afterwards)."""
    worker_env: dict[str, str] = field(default_factory=dict)
    daily_tag: str | None = None
    """A daily tag (docs/daily.md) of the steady tag's step, created with ``--daily``; None: not measured."""
    permuted_tag: str | None = None
    """A permuted tag (docs/permuted.md) of the steady tag's step, created with ``--permuted``; None: not measured."""


DAILY_WIDTH = 10
"""The daily tag's counter width in the bench: ten billion IDs a day, so no run exhausts it."""


STATE_DIR_IN_WORKDIR = "<workdir>/state"
"""Stands for the bench's temporary directory in ``ModePlan.worker_env`` (the plan is made before it exists)."""


def plan_for_mode(options: BenchOptions, run_id: str) -> ModePlan:
    """The tags and worker settings of ``options.mode``.

    Raises:
        BenchError: the mode is not available yet.
    """
    if options.mode == "segment":
        steady = f"bench-{run_id}-steady"
        switch = f"bench-{run_id}-switch"
        return ModePlan(
            mode="segment",
            kind="segment",
            steady_tag=steady,
            steady_step=options.step,
            switch_tag=switch,
            switch_step=options.switch_step,
            tags=[(steady, options.step, STEADY_START), (switch, options.switch_step, SWITCH_START)],
            daily_tag=f"bench-{run_id}-daily" if options.daily else None,
            permuted_tag=f"bench-{run_id}-permuted" if options.permuted else None,
            worker_env={
                "DISPENSER_SEGMENT_ENABLED": "true",
                "DISPENSER_SNOWFLAKE_ENABLED": "false",
                # The switch-over cases need segments of the tag's own step (1,000 IDs): the adaptive step
                # would grow them to minutes of demand and there would be nothing left to switch. The
                # rates are still measured and published, so their cost is in every figure.
                "DISPENSER_RATE_ADAPTIVE_STEP": "false",
            },
        )
    if options.mode == "snowflake":
        # One static worker ID, no segments: every request is answered from the clock.
        return ModePlan(
            mode="snowflake",
            kind="snowflake",
            steady_tag=f"bench-{run_id}",
            steady_step=None,
            switch_tag=None,
            switch_step=None,
            worker_env={
                "DISPENSER_SEGMENT_ENABLED": "false",
                "DISPENSER_SNOWFLAKE_ENABLED": "true",
                "DISPENSER_SNOWFLAKE_MODE": "static",
                "DISPENSER_SNOWFLAKE_WORKER_ID": "1",
                "DISPENSER_SNOWFLAKE_STATE_DIR": STATE_DIR_IN_WORKDIR,
            },
        )
    raise BenchError(f"unknown mode {options.mode!r}")


# -- the command line --------------------------------------------------------------------------------


def _inflight_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,64, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive numbers like 1,64, got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dispenser bench nats",
        description=(
            "Benchmark the dispenser worker against a trivial echo responder over one NATS server: "
            "requests/s, IDs/s and latency at 1 and 64 requests in flight, and segment switch-overs. "
            "Prints a table; the exit status is 0 unless --strict and a target is missed."
        ),
    )
    # Defaults are BenchOptions's, so that the command and the dataclass cannot disagree.
    parser.set_defaults(**dataclasses.asdict(BenchOptions()))
    parser.add_argument("--mode", choices=["segment", "snowflake"], help="generator")
    parser.add_argument("--duration", type=positive_float, help="measured seconds per case")
    parser.add_argument("--warmup", type=float, help="unmeasured seconds before each case")
    parser.add_argument(
        "--repeat",
        type=positive_int,
        help="measure each case N times, echo and dispenser alternating; report the best window by "
        "requests/s (the switch-over cases pool all N windows)",
    )
    parser.add_argument("--inflight", type=_inflight_list, help="requests in flight, e.g. 1,64 (default)")
    parser.add_argument("--json", type=Path, dest="json_path", metavar="PATH", help="write the report here")
    parser.add_argument("--nats-url", help="use this NATS server (default: start one)")
    parser.add_argument("--postgres-dsn", help="use this PostgreSQL database (default: start a server)")
    parser.add_argument(
        "--subject-prefix",
        help="subject prefix of the worker (default leaf); use another on a NATS server shared with workers",
    )
    parser.add_argument(
        "--step",
        type=positive_int,
        help="step of the steady tag (default 1e9: even ranges of 10,000 rarely switch segments)",
    )
    parser.add_argument("--switch-step", type=positive_int, help="step of the switch-over tag")
    parser.add_argument("--switch-count", type=positive_int, help="IDs per request on the switch-over tag")
    parser.add_argument(
        "--min-switches",
        type=int,
        help="measure the switch-over cases until this many replies landed on a switch-over (default 1000, "
        "so that their p999 is not just their maximum)",
    )
    parser.add_argument(
        "--switch-max-time",
        type=positive_float,
        help="but measure each switch-over case for at most this many seconds (default 60)",
    )
    parser.add_argument("--timeout", type=positive_float, help="seconds to wait for a reply")
    parser.add_argument(
        "--profile-worker",
        type=Path,
        metavar="PATH",
        help="run the worker under cProfile; write stats to PATH",
    )
    parser.add_argument(
        "--worker-command",
        metavar="CMD",
        help="start the worker with this command instead of `python -m dispenser serve` (to compare a "
        "variant; it gets the same DISPENSER_* environment)",
    )
    parser.add_argument(
        "--request-id",
        action="store_true",
        help="also measure ids/1 with a fresh request_id on every request, alternating with the same body "
        "without one (the cost of the fleet's replay record: docs/protocol.md)",
    )
    parser.add_argument(
        "--daily",
        action="store_true",
        help="also measure ids/1 on a daily tag (docs/daily.md) of the steady tag's step, alternating with "
        "the plain steady tag (segment mode, local only)",
    )
    parser.add_argument(
        "--permuted",
        action="store_true",
        help="also measure ids/1 on a permuted tag (docs/permuted.md) of the steady tag's step, "
        "alternating with the plain steady tag (segment mode, local only)",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--processes",
        type=positive_int,
        default=1,
        metavar="N",
        help="also measure the throughput bodies on `dispenser serve --processes N`, alternating with the one "
        "worker (local only; default 1: not)",
    )
    add_target_options(parser)
    return parser


def parse_options(argv: Sequence[str]) -> BenchOptions:
    """Options from command-line arguments (exits with usage on bad ones, like argparse does)."""
    parser = _parser()
    args = parser.parse_args(list(argv))
    deployment = deployment_of(parser, args)
    if deployment is not None and (args.profile_worker is not None or args.worker_command is not None):
        parser.error("--profile-worker and --worker-command start a worker here: not with --tag/--create-tag")
    if args.processes > 1 and (deployment is not None or args.worker_command is not None):
        parser.error("--processes starts workers here: not with --tag/--create-tag or --worker-command")
    if args.daily and (deployment is not None or args.mode != "segment"):
        parser.error("--daily creates a daily tag here: segment mode, not with --tag/--create-tag")
    if args.permuted and (deployment is not None or args.mode != "segment"):
        parser.error("--permuted creates a permuted tag here: segment mode, not with --tag/--create-tag")
    if deployment is not None and args.mode == "snowflake":
        parser.error("a deployment is measured in segment mode only (--mode snowflake starts its own worker)")
    if args.profile_worker is not None:
        args.profile_worker = args.profile_worker.absolute()
    return BenchOptions(**vars(args))
