"""Every error the dispenser can answer with: one class per situation, each with a code and a retry hint.

A client sees ``code`` (stable, machine-readable), ``message`` (for a person) and ``retryable`` (whether the
same request may succeed later). ``status`` is the HTTP-like number sent in the ``Nats-Service-Error-Code``
header, as the NATS services convention (ADR-32) expects. What only the worker's log and its operator may
read (where a dependency is: the DSN's hosts, port, user and database; the driver's own words) is in
``str(error)``, never in ``message``. Errors caused by the request itself also subclass
:class:`ValueError`. Foreign exceptions (asyncpg, kazoo, nats) are converted into these only in the
adapters; one handler in the service turns them into replies.
"""

from __future__ import annotations

__all__ = [
    "BadRequest",
    "ClockBehindRecorded",
    "ClockDisagreesWithPeers",
    "ClockMovedBackwards",
    "ClockOutOfRange",
    "CoordinatorUnavailable",
    "CountTooLarge",
    "DayExhausted",
    "DispenserError",
    "Forbidden",
    "InternalError",
    "InvalidCount",
    "InvalidId",
    "InvalidLayout",
    "InvalidRequest",
    "InvalidTag",
    "KindNotServed",
    "LeaseLost",
    "MalformedRequest",
    "MessageTooLarge",
    "OverBudget",
    "PeerClockUnverified",
    "ResidueOverlap",
    "StateDirUnusable",
    "StateFileCorrupt",
    "StoreRefusedValue",
    "StoreUnavailable",
    "TagExhausted",
    "TagExists",
    "TagStartTooLow",
    "Unauthorized",
    "Unavailable",
    "UnknownTag",
    "WorkerAddressInUse",
    "WorkerIdInUse",
    "WorkerIdOutOfRange",
    "WorkerIdsExhausted",
    "WorkerNodeAlive",
]


class DispenserError(Exception):
    """Base of every error that becomes an error reply."""

    code: str = "internal"
    status: int = 500
    retryable: bool = False

    def __init__(self, message: str, *, logged: str | None = None) -> None:
        """An error that answers ``message``; ``logged``: the same with what only the log may say.

        Args:
            message: what the caller is told (the error reply's ``message``).
            logged: ``str(error)``, for the worker's log and the operator's command line (default:
                ``message``): the message with where the dependency is and what its driver said.
        """
        super().__init__(message if logged is None else logged)
        self.message = message


class BadRequest(DispenserError, ValueError):
    """The request can never succeed as sent; fix it before retrying."""

    code = "bad_request"
    status = 400


class MalformedRequest(BadRequest):
    """The body is not valid JSON (or msgpack, when the client said so)."""

    code = "malformed"

    def __init__(self, detail: str) -> None:
        super().__init__(f"request body could not be decoded: {detail}")


class InvalidRequest(BadRequest):
    """The body decodes but a field has the wrong type or an unknown value (msgspec names the path)."""

    code = "invalid"

    def __init__(self, detail: str) -> None:
        super().__init__(f"invalid request: {detail}")


class InvalidCount(BadRequest):
    """``count`` is zero or negative."""

    code = "invalid_count"

    def __init__(self, count: int) -> None:
        super().__init__(f"count must be at least 1, got {count}")
        self.count = count


class CountTooLarge(BadRequest):
    """``count`` is over the configured limit for the requested format."""

    code = "count_too_large"
    status = 413

    def __init__(self, count: int, limit: int, fmt: str) -> None:
        hint = "; ask with format 'ranges' for larger batches" if fmt == "ids" else ""
        super().__init__(f"count {count} is over the limit of {limit} for format '{fmt}'{hint}")
        self.count = count
        self.limit = limit


class MessageTooLarge(BadRequest):
    """The request body is larger than any valid request could be."""

    code = "too_large"
    status = 413

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"request body of {size} bytes is over the limit of {limit} bytes")


class InvalidTag(BadRequest):
    """The tag does not match ``[A-Za-z0-9_.-]{1,128}``."""

    code = "invalid_tag"

    def __init__(self, tag: str) -> None:
        shown = tag if len(tag) <= 140 else tag[:140] + "…"
        super().__init__(f"tag {shown!r} is not valid: use 1 to 128 of A-Z a-z 0-9 _ . -")
        self.tag = tag


class KindNotServed(BadRequest):
    """The request names a generator kind this worker does not run (Kafka requests carry the kind)."""

    code = "kind_not_served"
    status = 404

    def __init__(self, kind: str, served: list[str]) -> None:
        super().__init__(
            f"this worker does not serve {kind!r} IDs (it serves: {', '.join(served) or 'none'})"
        )
        self.kind = kind


class UnknownTag(DispenserError, LookupError):
    """No such tag exists in the store (``dispenser tag add`` creates one)."""

    code = "unknown_tag"
    status = 404

    def __init__(self, tag: str) -> None:
        super().__init__(f"unknown tag {tag!r}: create it with `dispenser tag add {tag} --step N`")
        self.tag = tag


class Unavailable(DispenserError):
    """A dependency (store or coordinator) could not answer in time; retrying later may succeed."""

    code = "unavailable"
    status = 503
    retryable = True


class StoreUnavailable(Unavailable):
    """The segment store could not be reached, and the buffer for this tag ran dry."""

    def __init__(self, detail: str, *, logged: str | None = None) -> None:
        """``detail`` is what failed, for the caller; ``logged`` says where too (see :class:`DispenserError`)."""
        super().__init__(
            f"segment store unavailable: {detail}",
            logged=None if logged is None else f"segment store unavailable: {logged}",
        )


class StoreRefusedValue(BadRequest):
    """The store refused a value the request carries (PostgreSQL's data errors, SQLSTATE class 22).

    The store is up and answered: the same request can never be stored, so no retry helps. Raised for the
    one request whose value it was; the others written with it are not failed by it.
    """

    code = "invalid"

    def __init__(self, action: str, sqlstate: str, detail: str) -> None:
        super().__init__(
            f"{action}: the store refused a value of this request (SQLSTATE {sqlstate}: {detail})"
        )
        self.sqlstate = sqlstate
        self.reason = detail
        """The store's own words (PostgreSQL's message)."""


class TagExhausted(DispenserError):
    """The tag's next segment would pass the largest 64-bit ID (2**63 - 1): no retry can help."""

    code = "tag_exhausted"
    status = 507

    def __init__(self, tag: str, detail: str) -> None:
        super().__init__(detail)
        self.tag = tag


class DayExhausted(DispenserError):
    """A daily tag's counter for today has no digits left (docs/daily.md); it starts again at midnight."""

    code = "day_exhausted"
    status = 507

    def __init__(self, tag: str, day: int, capacity: int, zone: str) -> None:
        super().__init__(
            f"tag {tag!r} has handed out its {capacity} IDs of {day} (the counter's width): the next come "
            f"after midnight in {zone} (`dispenser tag set --width` widens the counter)"
        )
        self.tag = tag
        self.day = day


class ClockMovedBackwards(DispenserError):
    """The wall clock went back further than the generator may wait out; no ID was issued."""

    code = "clock_moved_backwards"
    status = 503
    retryable = True

    def __init__(self, last_ms: int, now_ms: int) -> None:
        super().__init__(
            f"clock moved backwards by {last_ms - now_ms} ms (last issued at {last_ms}, now {now_ms}); "
            "refusing to issue IDs until it has caught up"
        )
        self.last_ms = last_ms
        self.now_ms = now_ms


class InternalError(DispenserError):
    """An unexpected failure inside the worker; it is logged with its traceback."""

    def __init__(self, detail: str = "internal error") -> None:
        super().__init__(detail)


class TagExists(DispenserError, ValueError):
    """``tag add`` named a tag that is already in the store."""

    code = "tag_exists"
    status = 409

    def __init__(self, tag: str) -> None:
        super().__init__(
            f"tag {tag!r} already exists; change its step with `dispenser tag set {tag} --step N`"
        )
        self.tag = tag


class TagStartTooLow(DispenserError, ValueError):
    """``tag add`` asked for a first ID below a removed tag's high water: its IDs would come back."""

    code = "start_below_high_water"
    status = 409

    def __init__(self, tag: str, start: int, high_water: int) -> None:
        super().__init__(
            f"tag {tag!r} was removed after handing out IDs up to {high_water - 1}; adding it again from "
            f"{start} would hand them out again: add it with --start {high_water} or above (or --resume)"
        )
        self.tag = tag
        self.start = start
        self.high_water = high_water
        """The removed tag's ``max_id``: every ID it handed out is below it."""


class InvalidLayout(DispenserError, ValueError):
    """The configured snowflake bit layout cannot be used (too many bits, a bad field, an end past 9999)."""

    code = "invalid_layout"

    def __init__(self, detail: str) -> None:
        super().__init__(f"invalid snowflake layout: {detail}")


class WorkerIdOutOfRange(DispenserError, ValueError):
    """A worker id (configured, or handed out by the registry) or datacenter id does not fit its field."""

    code = "worker_id_out_of_range"

    def __init__(self, worker_id: int, max_worker_id: int, what: str = "worker id") -> None:
        super().__init__(
            f"{what} {worker_id} does not fit the snowflake layout: it must be between 0 and {max_worker_id}"
        )
        self.worker_id = worker_id
        self.max_worker_id = max_worker_id


class ClockOutOfRange(DispenserError):
    """The clock reads before the layout's epoch or after its last millisecond; no ID can express it."""

    code = "clock_out_of_range"
    status = 503

    def __init__(self, now_ms: int, first_ms: int, last_ms: int) -> None:
        where = "before the layout's epoch" if now_ms < first_ms else "past the layout's last millisecond"
        super().__init__(
            f"clock reads {now_ms} ms, {where} (the layout covers {first_ms} to {last_ms} ms since 1970); "
            "no ID was issued"
        )
        self.now_ms = now_ms
        self.first_ms = first_ms
        self.last_ms = last_ms


class ClockBehindRecorded(DispenserError):
    """The clock is behind the timestamp an earlier run of this worker recorded: no start, no ID."""

    code = "clock_behind_recorded"
    status = 503
    retryable = True

    def __init__(self, recorded_ms: int, now_ms: int) -> None:
        super().__init__(
            f"clock reads {now_ms} ms, {recorded_ms - now_ms} ms behind the timestamp {recorded_ms} recorded "
            "for this worker by an earlier run; refusing to issue IDs until the clock has passed it"
        )
        self.recorded_ms = recorded_ms
        self.now_ms = now_ms


class InvalidId(BadRequest):
    """The number given to decode is not an ID of the configured layout (negative, or too many bits)."""

    code = "invalid_id"

    def __init__(self, value: int, max_id: int) -> None:
        super().__init__(f"{value} is not an ID of this layout: IDs are between 0 and {max_id}")
        self.value = value
        self.max_id = max_id


class CoordinatorUnavailable(Unavailable):
    """The worker-ID registry (ZooKeeper, or Postgres in ``postgres`` mode) did not answer in time."""

    def __init__(self, detail: str, *, logged: str | None = None) -> None:
        """``detail`` is what failed, for the caller; ``logged`` says where too (see :class:`DispenserError`)."""
        super().__init__(
            f"worker-id coordinator unavailable: {detail}",
            logged=None if logged is None else f"worker-id coordinator unavailable: {logged}",
        )


class WorkerIdsExhausted(DispenserError):
    """Every worker ID the snowflake layout allows is taken; this worker cannot start."""

    code = "worker_ids_exhausted"
    status = 503

    def __init__(self, limit: int, where: str = "") -> None:
        """``where``: the registry (its hosts or DSN, and path or table), in ``str(error)`` only."""
        taken = f"all {limit} worker IDs (0 to {limit - 1}) allowed by the snowflake layout are taken"
        advice = "free one, or give the layout more worker bits"
        super().__init__(f"{taken}; {advice}", logged=f"{taken} in {where}; {advice}" if where else None)
        self.limit = limit


class LeaseLost(DispenserError):
    """This worker no longer holds its worker ID (its lease expired or its record was removed).

    The worker must stop issuing snowflake IDs and register again, which may yield another ID.
    """

    code = "lease_lost"
    status = 503
    retryable = True

    def __init__(self, worker_id: int, detail: str, *, logged: str | None = None) -> None:
        """``detail`` is why, for the caller; ``logged`` says where too (the registry's record: a node path)."""
        held = f"worker ID {worker_id} is no longer held by this worker"
        super().__init__(f"{held}: {detail}", logged=None if logged is None else f"{held}: {logged}")
        self.worker_id = worker_id
        self.detail = detail
        """Why, without the prefix (the caller's words)."""
        self.logged_detail = detail if logged is None else logged
        """Why, with where the record is (the log's words)."""


class WorkerIdInUse(DispenserError):
    """A live peer claims this worker's ID, or node bits its IDs share: this worker issues no snowflake ID.

    Two workers on one ID would hand out the same IDs (Leaf #187: a ZooKeeper per datacenter and no
    datacenter field). Retryable: another worker may serve the request.
    """

    code = "worker_id_in_use"
    status = 503
    retryable = True

    def __init__(self, datacenter_id: int, worker_id: int, holder: str, overlap: str = "") -> None:
        """``holder``: the live worker's address, in ``str(error)`` only (where a worker runs is the log's)."""

        def clash(who: str) -> str:
            if (
                overlap
            ):  # another layout (or epoch) whose node bits match ours: the pairs differ, the IDs do not
                return (
                    f"can issue the same IDs as {who} ({overlap}): this worker issues no snowflake IDs until "
                    "restarted; give every worker node bits of its own (one layout across the fleet, each "
                    "datacenter its own snowflake.datacenter_id; docs/snowflake.md)"
                )
            return (
                f"is also claimed by {who}: this worker issues no snowflake IDs until restarted; give each "
                "datacenter its own snowflake.datacenter_id (with datacenter_bits) or its own worker IDs"
            )

        mine = f"snowflake worker ID {worker_id} of datacenter {datacenter_id}"
        super().__init__(
            f"{mine} {clash('another live worker')}", logged=f"{mine} {clash(f'the live worker {holder}')}"
        )
        self.datacenter_id = datacenter_id
        self.worker_id = worker_id


class ResidueOverlap(DispenserError):
    """Another database serves this tag in a residue class that shares IDs with this database's class.

    Two databases handing out intersecting classes of one tag (the same offset, strides whose classes meet,
    or a plain tag beside a strided one) repeat each other's IDs (docs/datacenters.md). The worker that
    finds it serves no ID of the tag until the tag is re-added with a disjoint class (or it is restarted).
    Not retryable: the same worker answers the retry, and only an operator's change helps.
    """

    code = "residue_overlap"
    status = 409

    def __init__(self, tag: str, own: str, other: str, shared_ids: tuple[int, int] | None = None) -> None:
        shared = ""
        if shared_ids is not None:
            first, period = shared_ids
            shared = f" (IDs {first}, {first + period}, {first + 2 * period}, … are in both)"
        super().__init__(
            f"tag {tag!r} is not served by this worker: its class {own} intersects {other}{shared}; the two "
            "databases would hand out the same IDs. Give the tag one stride in every database and a different "
            "--offset in each (docs/datacenters.md)"
        )
        self.tag = tag


class WorkerAddressInUse(DispenserError):
    """Another live worker is registered under this worker's address, so it would share its worker ID."""

    code = "worker_address_in_use"
    status = 409

    def __init__(self, address: str, where: str = "") -> None:
        """``where``: the registry (its hosts and path), in ``str(error)`` only."""
        registered = f"another live worker is registered as {address!r}"
        advice = "give each worker its own address (ip:port), or wait until the other one has stopped"
        super().__init__(
            f"{registered}; {advice}", logged=f"{registered} in {where}; {advice}" if where else None
        )
        self.address = address


class WorkerNodeAlive(DispenserError):
    """Sharing Leaf's registry: this address's worker node is kept fresh by someone else (a live Leaf server).

    Leaf's scheme gives an address its own node, and so its worker ID, back: a worker configured with a
    running Leaf server's ``ip:port`` would issue that server's IDs. A live Leaf server rewrites its node
    every 3 s; a node rewritten by someone else while this worker watched it is not taken.
    """

    code = "worker_node_alive"
    status = 409

    def __init__(self, node: str, worker_id: int, writer: str, quiet_s: float) -> None:
        super().__init__(
            f"worker ID {worker_id} is in use by the Leaf server at {writer}: its node {node} was rewritten "
            "by someone else while this worker watched it (a live Leaf server rewrites its node every 3 s), "
            "and this worker would issue the same IDs; give this worker an address no Leaf server uses "
            f"(snowflake.address), or stop that Leaf server and start this worker once its node has been "
            f"quiet for {quiet_s:g} s"
        )
        self.node = node
        self.worker_id = worker_id
        self.writer = writer


class StateFileCorrupt(DispenserError):
    """The local snowflake state file exists but cannot be read as one; it is never silently ignored."""

    code = "state_file_corrupt"

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(
            f"local state file {path} is corrupt ({detail}); check it, then move it away to start without it"
        )
        self.path = path


class StateDirUnusable(DispenserError):
    """The state directory ``segment.remember_grants`` needs cannot be written: the worker does not start.

    Remembering in memory only would leave a restarted worker unable to repair a primary that lost its
    grants (docs/ha.md), silently; the worker refuses instead, as the snowflake side does.
    """

    code = "state_dir_unusable"

    def __init__(self, directory: str, detail: str) -> None:
        super().__init__(
            f"cannot keep the segment grants in {directory} ({detail}): set segment.state_dir to a writable "
            "directory that outlives the process, or segment.remember_grants = false to run without the "
            "repair of a primary that lost grants (docs/ha.md)"
        )
        self.directory = directory


class PeerClockUnverified(DispenserError):
    """The start-up clock query went unheard (``snowflake.peer_check_failure = "refuse"``): no start."""

    code = "peer_clock_unverified"
    status = 503
    retryable = True


class ClockDisagreesWithPeers(DispenserError):
    """At start-up, the local clock is further from the mean of the live peers' clocks than allowed."""

    code = "clock_disagrees_with_peers"
    status = 503

    def __init__(self, mean_offset_ms: float, threshold_ms: int, peers: int) -> None:
        direction = "ahead of" if mean_offset_ms < 0 else "behind"
        super().__init__(
            f"this machine's clock is {abs(mean_offset_ms):.0f} ms {direction} the mean of {peers} live peer(s), "
            f"more than the allowed {threshold_ms} ms; fix the clock (NTP) before starting a snowflake worker"
        )
        self.mean_offset_ms = mean_offset_ms


class Unauthorized(BadRequest):
    """An HTTP request without a token the worker knows (``http.callers`` is set: docs/security.md)."""

    code = "unauthorized"
    status = 401

    def __init__(self) -> None:
        super().__init__("this worker's HTTP API needs a known token: send 'Authorization: Bearer <token>'")


class Forbidden(BadRequest):
    """A known HTTP caller asked for a tag or kind its ``http.callers`` entry does not allow."""

    code = "forbidden"
    status = 403

    def __init__(self, caller: str, kind: str, tag: str) -> None:
        shown = tag if len(tag) <= 140 else tag[:140] + "…"
        super().__init__(f"caller {caller!r} may not take {kind} IDs of tag {shown!r}")


class OverBudget(DispenserError):
    """An HTTP caller asked for more IDs than its budget has left (``http.ids_per_second``, ``http.ids_burst``).

    Retryable: the budget refills at its rate (``retry_after`` says when this request would be granted),
    unless the request is larger than the burst, which it can never be.
    """

    code = "over_budget"
    status = 429

    def __init__(self, caller: str, count: int, rate: float, burst: float, retry_after: float) -> None:
        if retry_after == float("inf"):
            wait = f"a request of {count} IDs is over the burst and is never granted: ask for fewer"
        else:
            wait = f"retry in {retry_after:.3g} s"
        super().__init__(
            f"caller {caller!r} is over its ID budget ({rate:.6g} IDs/s, bursts up to {burst:.6g}): {wait}"
        )
        self.retry_after = retry_after
        self.retryable = retry_after != float("inf")
