"""Claims on a tag's residue class, exchanged by workers on different databases (docs/datacenters.md).

A worker claims ``(tag, database, class)`` when it starts serving the tag. Two claims on one tag from two
databases whose classes intersect (:meth:`Residue.intersects`) would hand out the same IDs: the rules that
decide who refuses are :func:`rivals` and the guard in ``service/residues.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from dispenser.core.residue import Residue

__all__ = ["Database", "ResidueClaim", "ResidueState", "clashes", "overlaps", "rivals"]

ResidueState = Literal["serving", "refused"]
"""A claim's phase: the worker hands out the tag's IDs, or refuses to (it found an intersecting class)."""


@dataclass(frozen=True, slots=True)
class Database:
    """Which database a tag's row lives in: PostgreSQL's system identifier and the database's name.

    A Patroni cluster keeps one system identifier across failovers; two databases of one server share it
    and differ by name. A cluster cloned from another (``pg_basebackup``, a restored snapshot) keeps the
    original's identifier, so it is taken for the same database (docs/datacenters.md says so).
    """

    system_identifier: str
    name: str

    def describe(self) -> str:
        """The database in a message."""
        return f"database {self.name!r} of PostgreSQL system {self.system_identifier}"


@dataclass(frozen=True, slots=True)
class ResidueClaim:
    """A worker's claim on one tag's class in its database."""

    tag: str
    database: Database
    residue: Residue
    worker: str
    """Who claims: the worker's name (``<host>:<pid>:<random>``, as in its rate events)."""
    state: ResidueState = "serving"
    issued: bool = False
    """Whether the worker handed out IDs under this claim (a refusal after serving still counts)."""
    datacenter: str = ""

    @property
    def live(self) -> bool:
        """Whether another database's intersecting class would repeat this claim's IDs: it serves, or served."""
        return self.state == "serving" or self.issued

    def describe(self) -> str:
        """The claim in a log line: class, database, worker."""
        where = f" in {self.datacenter}" if self.datacenter else ""
        residue = self.residue
        return (
            f"{residue.offset} mod {residue.stride} in {self.database.describe()}, "
            f"worker {self.worker}{where} ({self.state})"
        )


def overlaps(own: ResidueClaim, other: ResidueClaim) -> bool:
    """Whether ``other`` is another database's claim on ``own``'s tag whose class shares an ID with it."""
    return (
        other.tag == own.tag
        and other.worker != own.worker
        and other.database != own.database
        and own.residue.intersects(other.residue)
    )


def rivals(own: ResidueClaim, others: Iterable[ResidueClaim]) -> list[ResidueClaim]:
    """The live claims of other databases that intersect ``own`` (a claim refused before serving is not one)."""
    return [c for c in others if c.live and overlaps(own, c)]


def clashes(claims: Iterable[ResidueClaim]) -> list[tuple[ResidueClaim, ResidueClaim]]:
    """Pairs of live claims of two databases on one tag whose classes intersect (one pair per two databases)."""
    by_tag: dict[str, list[ResidueClaim]] = {}
    for claim in claims:
        if claim.live:
            by_tag.setdefault(claim.tag, []).append(claim)
    found: dict[tuple[str, Database, Database], tuple[ResidueClaim, ResidueClaim]] = {}
    for tag, group in sorted(by_tag.items()):
        for i, one in enumerate(group):
            for other in group[i + 1 :]:
                if overlaps(one, other):
                    first, second = sorted(
                        (one, other), key=lambda c: (c.database.system_identifier, c.database.name)
                    )
                    found.setdefault((tag, first.database, second.database), (first, second))
    return list(found.values())
