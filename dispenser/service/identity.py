"""The guard against two live workers that can issue one same ID, whatever the configuration.

Snowflake workers exchange claims (datacenter, worker, the node bits they put in their IDs on their layout,
a nonce of the run, its phase) on the clock subject,
at start and every ``snowflake.peer_recheck_interval``. No broker here: the wiring passes the claims in
(:meth:`IdentityGuard.heard`) and sends :meth:`claim`. The rules, and why they are safe:
``docs/snowflake.md`` ("Two workers on one ID").
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable

from dispenser.core.errors import WorkerIdInUse
from dispenser.core.node_bits import node_bits
from dispenser.core.peers import Claim, ClaimState, rival_claims
from dispenser.core.snowflake import SnowflakeLayout

__all__ = ["IdentityGuard"]

log = logging.getLogger(__name__)


class IdentityGuard:
    """One worker's claim on its snowflake ID, and its verdict on the rivals it hears.

    Args:
        datacenter_id: The configured datacenter ID.
        worker_id: Reads the worker ID the worker issues under now (the registry may hand out another).
        address: The worker's registry address, named in the messages.
        on_refuse: Called once, with the error, when the worker must stop issuing.
        layout: The worker's layout (Leaf's by default): its claim says the node bits it puts in its IDs,
            and a peer whose node bits can compose one of its IDs is a rival, whatever its pair.
    """

    def __init__(
        self,
        datacenter_id: int,
        worker_id: Callable[[], int],
        address: str = "",
        on_refuse: Callable[[WorkerIdInUse], None] | None = None,
        *,
        layout: SnowflakeLayout | None = None,
    ) -> None:
        self.datacenter_id = datacenter_id
        self.layout = layout if layout is not None else SnowflakeLayout()
        self._worker_id = worker_id
        self.address = address
        self.nonce = secrets.token_hex(8)
        """Random per run: tells this run's claim from any other's."""
        self.state: ClaimState = "starting"
        self.refusal: WorkerIdInUse | None = None
        """Why this worker refuses to issue (None: it does not)."""
        self.turned_away: list[Claim] = []
        """Starting rivals this serving worker heard (each refused on hearing this worker's answer)."""
        self.on_refuse = on_refuse

    def claim(self) -> Claim:
        """This worker's claim now."""
        worker_id = self._worker_id()
        bits = node_bits(self.layout, self.datacenter_id, worker_id)
        return Claim(self.datacenter_id, worker_id, self.nonce, self.state, self.address, bits)

    def heard(self, claims: Iterable[Claim]) -> WorkerIdInUse | None:
        """Judge the claims heard from live peers (answers to a check, or a peer's own check).

        Returns:
            The refusal, if this worker refuses (now or before).
        """
        if self.refusal is not None:
            return self.refusal
        own = self.claim()
        for rival in rival_claims(own, claims):
            if self.state == "starting" or rival.issuing:
                self._refuse(own, rival)
                return self.refusal
            if rival.nonce not in {c.nonce for c in self.turned_away}:
                self.turned_away.append(rival)
                log.warning(
                    "a worker starting with this worker's snowflake ID (datacenter %d, worker %d) was "
                    "turned away: %s; check its snowflake.datacenter_id and registry",
                    own.datacenter_id,
                    own.worker_id,
                    rival.describe(),
                )
        return None

    def hear(self, claim: Claim) -> None:
        """Judge one claim (a checking peer's, heard by this worker's answerer)."""
        self.heard([claim])

    def started(self) -> None:
        """The start-up check found no rival: serve (a no-op once refused)."""
        if self.state == "starting":
            self.state = "serving"

    def _refuse(self, own: Claim, rival: Claim) -> None:
        self.state = "refused"
        overlap = ""
        if (
            own.bits is not None
            and rival.bits is not None
            and (own.node, own.bits) != (rival.node, rival.bits)
        ):
            overlap = f"ours: {own.bits.describe()}; theirs: datacenter {rival.datacenter_id}, worker "
            overlap += f"{rival.worker_id}, {rival.bits.describe()}"
        self.refusal = WorkerIdInUse(own.datacenter_id, own.worker_id, rival.describe(), overlap)
        log.error("%s", self.refusal)
        if self.on_refuse is not None:
            self.on_refuse(self.refusal)
