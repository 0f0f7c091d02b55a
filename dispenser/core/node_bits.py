"""The bits a snowflake worker puts in every ID it issues, and whether two workers' IDs can ever be equal.

A worker on a layout issues IDs ``0 | timestamp | node | sequence`` where the node field (datacenter and
worker IDs side by side) is fixed for the run and everything else varies: the timestamp takes every value
from 0 to its maximum as time passes (from the layout's epoch), and the sequence every value within a
millisecond. So the IDs a worker can ever issue are exactly the numbers below ``2 ** id_bits`` whose node
field holds its node value; which epoch the timestamp counts from does not matter (a layout with an epoch
``d`` ms later issues ``d`` ms later the IDs the earlier one issued; it does not issue other ones).

Two workers can issue one same ID exactly when some number satisfies both descriptions: the two node
fields agree on every bit position they share, and neither sets a bit at or above the other's ID width
(where the other's IDs are all 0). When they do not, the node bits alone keep the two ID spaces apart, at
every time, whatever the two clocks, epochs or timestamp shifts. This is the only rule that separates
workers safely: time cannot (epochs and clocks differ, and IDs are issued for decades), so a claim on a
layout unlike ours is judged by its node bits, never by its (datacenter, worker) pair.
"""

from __future__ import annotations

from dataclasses import dataclass

from dispenser.core.snowflake import SnowflakeLayout

__all__ = ["NodeBits", "can_collide", "node_bits"]


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeBits:
    """Where a worker's node field sits in its IDs and what it holds.

    Attributes:
        shift: The lowest bit of the node field (the layout's ``sequence_bits``).
        width: The node field's width (``datacenter_bits + worker_bits``).
        value: The node field's value (``datacenter_id << worker_bits | worker_id``).
        id_bits: The width of the worker's IDs: every bit from here up is 0 (63 for a full layout).
        epoch_ms: The layout's epoch: named in messages, never a reason to tell two workers apart.
    """

    shift: int
    width: int
    value: int
    id_bits: int
    epoch_ms: int

    @property
    def mask(self) -> int:
        """The node field's bits, in place."""
        return ((1 << self.width) - 1) << self.shift

    @property
    def placed(self) -> int:
        """The node value, in place: the bits the worker ORs into every ID."""
        return self.value << self.shift

    def describe(self) -> str:
        """The field in a log line: ``node bits 12-21 = 32, epoch 1288834974657``."""
        if self.width == 0:
            where = "no node bits"
        else:
            where = f"node bits {self.shift}-{self.shift + self.width - 1} = {self.value}"
        return f"{where}, {self.id_bits}-bit IDs, epoch {self.epoch_ms}"


def node_bits(layout: SnowflakeLayout, datacenter_id: int, worker_id: int) -> NodeBits:
    """The node bits of the worker ``(datacenter_id, worker_id)`` on ``layout``.

    Raises:
        WorkerIdOutOfRange: ``datacenter_id`` or ``worker_id`` does not fit the layout.
    """
    placed = layout.node_part(datacenter_id, worker_id)
    return NodeBits(
        shift=layout.sequence_bits,
        width=layout.datacenter_bits + layout.worker_bits,
        value=placed >> layout.sequence_bits,
        id_bits=layout.timestamp_shift + layout.timestamp_bits,
        epoch_ms=layout.epoch_ms,
    )


def can_collide(a: NodeBits, b: NodeBits) -> bool:
    """Whether some ID can be issued both by a worker with node bits ``a`` and one with ``b`` (symmetric).

    False only when the node bits provably keep the two ID spaces apart: the fields differ on a bit
    position both fix, or one sets a bit the other's IDs never have (at or above its ``id_bits``).
    """
    shared = a.mask & b.mask
    if (a.placed ^ b.placed) & shared:
        return False  # a bit both fields fix, set in one and clear in the other
    top = min(a.id_bits, b.id_bits)
    # Above the narrower ID width the narrower worker's IDs are 0: a node bit set there is never shared.
    return (a.placed | b.placed) >> top == 0
