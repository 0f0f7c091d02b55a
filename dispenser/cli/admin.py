"""The ``dispenser`` commands that administer the database: ``migrate``, ``tag`` and ``import-leaf``.

The schema is created or upgraded, segment tags are added, listed, changed and removed, and Leaf's tags are
copied from its MySQL database.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from dispenser.arguments import non_negative_int, positive_float, positive_int
from dispenser.cli.common import AddParser
from dispenser.config import Config
from dispenser.core.daily import MAX_WIDTH, DailyPolicy, compose
from dispenser.core.errors import BadRequest, DispenserError, TagStartTooLow, UnknownTag
from dispenser.core.residue import Residue
from dispenser.ports import SegmentStore, TagInfo
from dispenser.runner import run_async

__all__ = [
    "LEAF_MYSQL_ENV",
    "add_import_leaf",
    "add_migrate",
    "add_tag",
    "daily_of",
    "ordered_of",
    "residue_of",
    "run_import_leaf",
    "run_migrate",
    "run_tag",
    "set_policy",
]

T = TypeVar("T")

LEAF_MYSQL_ENV = "LEAF_MYSQL_DSN"
"""Where ``dispenser import-leaf`` finds Leaf's database when ``--mysql`` is not given."""


def add_migrate(add_parser: AddParser) -> None:
    """``dispenser migrate``: how long to wait for table locks."""
    migrate = add_parser(
        "migrate",
        help="create or upgrade the tables in PostgreSQL (idempotent)",
        description=(
            "Create leaf_alloc (Leaf's own table) and the dispenser's tables in postgres.dsn, or upgrade them "
            "to this version's schema. Safe to run again, and on a database Leaf already uses (existing "
            "rows are kept). Behind a long transaction it waits for a table lock at most --lock-timeout at a "
            "time (fetches queued behind it wait that long), rolls back and tries again until "
            "--lock-retry-for has passed, then exits 1 with nothing applied."
        ),
    )
    migrate.add_argument(
        "--lock-timeout",
        type=positive_float,
        help="seconds one attempt waits for a table lock (default 1)",
    )
    migrate.add_argument(
        "--lock-retry-for",
        type=positive_float,
        help="seconds of attempts before giving up (default 60)",
    )


def add_tag(add_parser: AddParser, common: argparse.ArgumentParser) -> None:
    """``dispenser tag add|list|set|remove``; each action takes the global options (``common``) too."""
    tag = add_parser(
        "tag",
        help="administer segment tags",
        description="Create, list, change and remove segment tags (rows of leaf_alloc) in postgres.dsn.",
    )
    tag_sub = tag.add_subparsers(dest="tag_command", required=True, metavar="ACTION")
    add = tag_sub.add_parser("add", help="create a tag", parents=[common])
    add.add_argument("tag", help="the tag's name (letters, digits, - _ ., at most 128 characters)")
    add.add_argument("--step", type=positive_int, required=True, help="IDs per segment (at least 1)")
    add.add_argument(
        "--start",
        type=positive_int,
        default=1,
        help="first ID (default 1); refused below the high water of a removed tag of that name",
    )
    add.add_argument(
        "--resume",
        action="store_true",
        help="a tag removed before: start where it stopped (its high water), so its IDs never come back",
    )
    add.add_argument("--description", default="", help="free text")
    add.add_argument(
        "--stride",
        type=positive_int,
        default=1,
        help="a database per datacenter: hand out only IDs equal to --offset modulo this (the same in "
        "every datacenter; default 1, Leaf's tag). Set once: never change it",
    )
    add.add_argument(
        "--offset",
        type=int,
        default=None,
        help="this datacenter's residue, 0 to --stride - 1, different in each datacenter; required with "
        "--stride above 1 (a default would be the same in every datacenter)",
    )
    add.add_argument(
        "--daily",
        action="store_true",
        help="a daily tag (docs/daily.md): IDs are the date YYYYMMDD then a counter of --width digits that "
        "starts again at 1 each midnight in --time-zone (e.g. 20261128000001)",
    )
    add.add_argument(
        "--width",
        type=positive_int,
        default=None,
        help=f"with --daily: the counter's digits, 1 to {MAX_WIDTH} (default 6: 999999 IDs a day)",
    )
    add.add_argument(
        "--time-zone",
        default=None,
        metavar="ZONE",
        help="with --daily: the IANA zone whose midnight starts a new day, e.g. Asia/Shanghai (default UTC)",
    )
    _add_ordered(add)
    _add_permuted(add)
    tag_sub.add_parser("list", help="list tags with their next ID and step", parents=[common])
    _add_set(tag_sub, common)
    remove = tag_sub.add_parser(
        "remove",
        help="delete a tag (its high water is kept: adding it again below is refused)",
        parents=[common],
    )
    remove.add_argument("tag", help="the tag's name")


def _add_set(tag_sub: Any, common: argparse.ArgumentParser) -> None:
    """``dispenser tag set``: a tag's step, ordering, permutation, or a daily tag's width or zone."""
    set_ = tag_sub.add_parser(
        "set",
        help="change a tag's step, ordering, permutation, or a daily tag's width or zone",
        parents=[common],
    )
    set_.add_argument("tag", help="the tag's name")
    set_.add_argument("--step", type=positive_int, help="IDs per segment (at least 1)")
    set_.add_argument(
        "--width",
        type=positive_int,
        help=f"a daily tag's counter digits, 1 to {MAX_WIDTH} (from the workers' next tag refresh; docs/daily.md)",
    )
    set_.add_argument(
        "--time-zone", metavar="ZONE", help="a daily tag's zone (from the workers' next tag refresh)"
    )
    _add_ordered(set_, plain=True)
    _add_permuted(set_, existing=True)


def add_import_leaf(add_parser: AddParser) -> None:
    """``dispenser import-leaf``: Leaf's database, which tags, and how far above Leaf's IDs to start."""
    leaf = add_parser(
        "import-leaf",
        help="copy every tag from a Leaf MySQL database, each starting above anything Leaf can have granted",
        description=(
            "Copy Leaf's leaf_alloc tags into the dispenser's PostgreSQL (postgres.dsn), each starting at "
            "Leaf's max_id plus a margin. Stop every Leaf server first (docs/migrating-from-leaf.md). "
            "Safe to run again: a tag already at or above its safe start is left alone, none is lowered."
        ),
    )
    leaf.add_argument(
        "--mysql",
        metavar="DSN",
        help=f"Leaf's database, mysql://user:password@host:port/database (default: ${LEAF_MYSQL_ENV})",
    )
    leaf.add_argument(
        "--tags", metavar="A,B", help="only these tags (comma-separated; each must exist in Leaf)"
    )
    leaf.add_argument("--dry-run", action="store_true", help="print what would be done, write nothing")
    leaf.add_argument(
        "--force",
        action="store_true",
        help="raise tags the dispenser already has below their safe start (never lowers a tag)",
    )
    leaf.add_argument(
        "--margin",
        type=non_negative_int,
        metavar="N",
        help="IDs to start above Leaf's max_id (default: max(step, 1000000), one largest Leaf segment)",
    )


def _add_permuted(parser: argparse.ArgumentParser, *, existing: bool = False) -> None:
    """``--permuted`` (docs/permuted.md); ``existing``: ``--no-permuted`` too (``tag set``)."""
    parser.add_argument(
        "--permuted",
        action="store_true",
        help="IDs that hide volume and order (docs/permuted.md): each worker answers a keyed permutation of "
        "the counter with the tag's key file in segment.permute_keys_dir, and one without it refuses the tag"
        + (
            " (from its next tag refresh; until then it may answer plain IDs, never the same)"
            if existing
            else ""
        ),
    )
    if existing:
        parser.add_argument(
            "--no-permuted",
            action="store_true",
            help="take the mark off: workers without the key file answer plain IDs again (from their next "
            "tag refresh); a worker with it permutes as long as it has the file (docs/permuted.md)",
        )


def _add_ordered(parser: argparse.ArgumentParser, *, plain: bool = False) -> None:
    """``--ordered`` and ``--lease`` (docs/ordered.md); ``plain``: ``--plain`` too (``tag set``)."""
    parser.add_argument(
        "--ordered",
        action="store_true",
        help="strictly increasing across the fleet (docs/ordered.md): one worker at a time answers it over "
        "NATS, the others forward (HTTP and Kafka requests too, over NATS; refused without NATS)",
    )
    parser.add_argument(
        "--lease",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --ordered: the owner's lease (default 3): a killed owner's successor answers after it",
    )
    if plain:
        parser.add_argument(
            "--plain", action="store_true", help="an ordered tag no more (every worker within a second)"
        )


async def _ordered(store: Any, tag: str, ttl: float | None) -> None:
    """Make ``tag`` ordered (a daily tag refused: its IDs restart each day) or, ``ttl`` None, plain."""
    from dispenser.adapters.postgres.ordered import set_ordered  # noqa: PLC0415 - imports asyncpg

    if ttl is not None:
        info = next((i for i in await store.list_tags() if i.tag == tag), None)
        if info is None:
            raise UnknownTag(tag)
        if info.daily is not None:
            raise BadRequest(f"tag {tag!r} is a daily tag: its counters start again each day, never ordered")
        if info.permuted:
            raise BadRequest(f"tag {tag!r} is permuted: its IDs are in no order by design (docs/permuted.md)")
    await set_ordered(store, tag, ttl)


async def _mark(store: Any, tag: str, permuted: bool) -> TagInfo:
    """Mark ``tag`` permuted (an ordered tag refused: the ordered route answers without the permutation) or not."""
    if permuted:
        _, leases = await _tags_and_leases(store)
        if tag in leases:
            raise BadRequest(
                f"tag {tag!r} is ordered: a permuted tag's IDs are in no order (docs/permuted.md)"
            )
    info: TagInfo = await store.set_permuted(tag, permuted)
    return info


async def _tags_and_leases(store: Any) -> tuple[list[TagInfo], dict[str, float]]:
    """The tags, and the ordered ones' lease seconds (none before schema version 9)."""
    from dispenser.adapters.postgres.ordered import PostgresLeases  # noqa: PLC0415 - imports asyncpg

    tags = await store.list_tags()
    try:
        rows = await PostgresLeases(store).ordered()
    except DispenserError:
        rows = {}
    return tags, {tag: row.ttl for tag, row in rows.items()}


def ordered_of(args: argparse.Namespace) -> float | None:
    """``--ordered`` and ``--lease`` as the lease's seconds (None: not ordered; BadRequest when they clash)."""
    if not args.ordered:
        if args.lease is not None:
            raise BadRequest("--lease is an ordered tag's: add --ordered")
        return None
    if getattr(args, "daily", False) or getattr(args, "plain", False):
        raise BadRequest("--ordered goes with neither --daily nor --plain")
    return 3.0 if args.lease is None else args.lease


def _with_store(config: Config, action: Callable[[Any], Awaitable[T]]) -> T:
    """Run ``action`` on a PostgreSQL segment store of ``postgres.dsn``, connected for it alone."""
    from dispenser.adapters.postgres.segments import PostgresSegmentStore  # noqa: PLC0415

    async def go() -> T:
        async with await PostgresSegmentStore.connect(config.postgres.dsn, command_timeout=10.0) as store:
            return await action(store)

    return run_async(go())


def run_migrate(args: argparse.Namespace, config: Config) -> int:
    """Create or upgrade the schema; print the versions applied."""
    from dispenser.adapters.postgres.schema import migrate  # noqa: PLC0415

    # Unset: the defaults of migrate() (the schema module imports asyncpg, so it is not imported up here).
    limits = {name: getattr(args, name) for name in ("lock_timeout", "lock_retry_for") if getattr(args, name)}
    applied = run_async(migrate(config.postgres.dsn, **limits))
    if applied:
        print(f"applied schema version(s) {', '.join(map(str, applied))}")
    else:
        print("schema is up to date")
    return 0


def run_tag(args: argparse.Namespace, config: Config) -> int:
    """Add, list, change or remove segment tags."""
    if args.tag_command == "list":
        infos, leases = _with_store(config, _tags_and_leases)
        print(f"{'TAG':<32} {'NEXT ID':>20} {'STEP':>10}  DESCRIPTION")
        for info in infos:
            daily = info.daily
            kind = "" if daily is None else f"[daily: width {daily.width}, {daily.time_zone}] "
            kind += f"[ordered, lease {leases[info.tag]:g} s] " if info.tag in leases else ""
            kind += "[permuted] " if info.permuted else ""
            print(f"{info.tag:<32} {info.max_id:>20} {info.step:>10}  {kind}{info.description}")
        return 0
    if args.tag_command == "add":
        daily, lease = daily_of(args), ordered_of(args)
        if args.permuted and (daily is not None or lease is not None):
            raise BadRequest("--permuted goes with neither --daily nor --ordered")
        info = _with_store(config, lambda store: _add_or_resume(store, args, daily))
        if lease is not None:
            _with_store(config, lambda store: _ordered(store, args.tag, lease))
            print(
                f"added ordered tag {info.tag!r}: first ID {info.max_id}, step {info.step}, lease {lease:g} s"
            )
        elif daily is None:
            permuted = " (permuted: docs/permuted.md)" if info.permuted else ""
            print(f"added tag {info.tag!r}: first ID {info.max_id}, step {info.step}{permuted}")
        else:
            print(
                f"added daily tag {info.tag!r}: IDs YYYYMMDD then {daily.width} digits from 1 each midnight "
                f"in {daily.time_zone} (e.g. {compose(20261128, 1, daily.width)}), step {info.step}"
            )
    elif args.tag_command == "set":
        _run_set(args, config)
    else:
        _with_store(config, lambda store: store.remove_tag(args.tag))
        print(f"removed tag {args.tag!r}")
    return 0


def _run_set(args: argparse.Namespace, config: Config) -> None:
    """``tag set``: each option given, one connection each, in this order."""
    lease = ordered_of(args)  # set_policy checked the arguments before connecting (cli._check_arguments)
    if lease is not None or args.plain:
        _with_store(config, lambda store: _ordered(store, args.tag, lease))
        print(
            f"tag {args.tag!r} is plain from the workers' next start (docs/ordered.md)"
            if lease is None
            else f"tag {args.tag!r} is ordered, lease {lease:g} s (within a second on every worker)"
        )
    if args.permuted or args.no_permuted:
        _with_store(config, lambda store: _mark(store, args.tag, args.permuted))
        print(
            f"tag {args.tag!r} is permuted from each worker's next tag refresh: a worker with its key file "
            "answers permuted IDs, one without it refuses the tag (docs/permuted.md)"
            if args.permuted
            else f"tag {args.tag!r} is no longer marked permuted: workers without its key file answer plain "
            "IDs from their next tag refresh; those with it permute until it is removed and they restart"
        )
    if args.step is not None:
        info = _with_store(config, lambda store: store.set_step(args.tag, args.step))
        print(f"tag {info.tag!r}: step is now {info.step} (from its next segment)")
    if args.width is not None or args.time_zone is not None:
        info = _with_store(config, lambda store: _set_daily(store, args))
        assert info.daily is not None
        print(
            f"daily tag {info.tag!r}: width {info.daily.width}, zone {info.daily.time_zone} (from the "
            "workers' next tag refresh)"
        )


def run_import_leaf(args: argparse.Namespace, config: Config) -> int:
    """Copy Leaf's tags; exit 2 on bad arguments, 1 if any tag was not imported."""
    from dispenser.leaf_import import import_leaf  # noqa: PLC0415 - imports the MySQL driver

    # The DSN holds a password: from the environment it stays out of `ps` and the shell's history.
    dsn = args.mysql or os.environ.get(LEAF_MYSQL_ENV)
    if not dsn:
        print(
            f"dispenser import-leaf: give Leaf's database with --mysql DSN or ${LEAF_MYSQL_ENV}",
            file=sys.stderr,
        )
        return 2
    tags = None if args.tags is None else [t.strip() for t in args.tags.split(",") if t.strip()]
    if tags is not None and not tags:
        print("dispenser import-leaf: --tags names no tag", file=sys.stderr)
        return 2
    try:
        report = run_async(
            import_leaf(
                dsn,
                config.postgres.dsn,
                tags=tags,
                margin=args.margin,
                force=args.force,
                dry_run=args.dry_run,
            )
        )
    except ValueError as exc:
        print(f"dispenser import-leaf: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # the leaf-import extra is missing
        print(f"dispenser import-leaf: {exc}", file=sys.stderr)
        return 1
    for warning in report.warnings:
        print(f"WARNING: {warning}", file=sys.stderr)
    print("\n".join(report.lines()))
    if report.failed:
        print(
            f"dispenser import-leaf: {len(report.failed)} tag(s) not imported: "
            f"{', '.join(p.row.tag for p in report.failed)}",
            file=sys.stderr,
        )
        return 1
    return 0


def residue_of(args: argparse.Namespace) -> Residue:
    """``--stride`` and ``--offset`` as a residue class (BadRequest when they do not make one).

    ``--offset`` has no default with a stride: the same command run in two datacenters would give both
    offset 0, and every ID would be handed out twice (docs/datacenters.md).
    """
    if args.offset is None and args.stride > 1:
        raise BadRequest(
            f"--offset is required with --stride {args.stride}: give each datacenter's database its own "
            f"offset, 0 to {args.stride - 1} (the same offset in two databases hands out every ID twice)"
        )
    try:
        return Residue(args.stride, args.offset or 0)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def set_policy(args: argparse.Namespace) -> None:
    """``tag set``: something to set, a width and a zone that are valid (BadRequest otherwise)."""
    ordered_of(args)
    if (
        args.step is None
        and args.width is None
        and args.time_zone is None
        and not (args.ordered or args.plain or args.permuted or args.no_permuted)
    ):
        raise BadRequest(
            "tag set: give --step, or a daily tag's --width or --time-zone, or --ordered or --plain, or "
            "--permuted or --no-permuted"
        )
    if args.permuted and args.no_permuted:
        raise BadRequest("--permuted or --no-permuted: not both")
    if args.permuted and args.ordered:
        raise BadRequest("--permuted goes not with --ordered: a permuted tag's IDs are in no order")
    if args.permuted and (args.width is not None or args.time_zone is not None):
        raise BadRequest("--permuted goes not with --width or --time-zone: a daily tag is never permuted")
    DailyPolicy.checked(1 if args.width is None else args.width, args.time_zone or "UTC")


async def _set_daily(store: SegmentStore, args: argparse.Namespace) -> TagInfo:
    """``tag set --width/--time-zone``: what is not given stays as it is."""
    current = next((info for info in await store.list_tags() if info.tag == args.tag), None)
    if current is None:
        raise UnknownTag(args.tag)
    if current.daily is None:
        raise BadRequest(
            f"tag {args.tag!r} is not a daily tag: its IDs could meet a daily tag's; add a new tag with --daily"
        )
    width = current.daily.width if args.width is None else args.width
    zone = current.daily.time_zone if args.time_zone is None else args.time_zone
    return await store.set_daily(args.tag, DailyPolicy.checked(width, zone))


def daily_of(args: argparse.Namespace) -> DailyPolicy | None:
    """``--daily``, ``--width`` and ``--time-zone`` as a policy (BadRequest when they do not make one)."""
    if not args.daily:
        if args.width is not None or args.time_zone is not None:
            raise BadRequest("--width and --time-zone describe a daily tag: add --daily")
        return None
    return DailyPolicy.checked(6 if args.width is None else args.width, args.time_zone or "UTC")


async def _add_or_resume(store: SegmentStore, args: argparse.Namespace, daily: DailyPolicy | None) -> TagInfo:
    """``tag add``: with ``--resume``, a removed tag starts at its high water (or ``--start``, if higher)."""

    async def add(start: int) -> TagInfo:
        return await store.add_tag(
            args.tag,
            args.step,
            start,
            args.description,
            residue=residue_of(args),
            daily=daily,
            permuted=args.permuted,
        )

    try:
        return await add(args.start)
    except TagStartTooLow as exc:
        if not args.resume:
            raise
        return await add(exc.high_water)
