"""Leaf's MySQL as Leaf itself leaves it: its DDL, its sample row, and its segment fetches, for import-leaf tests."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from dispenser_lab.servers.mariadb import MariaDBServer

# Leaf's README (scripts/leaf_alloc.sql), as published: the lab's copy, the one the capture of Leaf's answers loads.
LEAF_DDL, _LEAF_ROW = (
    resources.files("dispenser_lab.leaf").joinpath("leaf_alloc.sql").read_text().split("\n\n")
)
LEAF_SAMPLE_ROW = _LEAF_ROW.strip().removesuffix(";")


def _quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "''") + "'"


@dataclass(frozen=True)
class LeafMySQL:
    """One test's database holding Leaf's ``leaf_alloc``, and what Leaf's servers do to it."""

    server: MariaDBServer
    database: str
    dsn: str

    def sql(self, statements: str) -> str:
        """Run SQL in this database (as root, through the socket)."""
        return self.server.sql(statements, database=self.database)

    def add(self, tag: str, step: int, max_id: int = 1, description: str = "") -> None:
        """A row as Leaf's operators add one (Leaf's README: ``insert into leaf_alloc(…)``)."""
        self.add_row(tag, step, max_id, description)

    def add_row(
        self, tag: str, step: int, max_id: int, description: str, column: str = "description"
    ) -> None:
        """A row, with the description in ``column`` (```desc``` in Leaf's first DDL)."""
        self.sql(
            f"insert into leaf_alloc(biz_tag, max_id, step, `{column}`) "
            f"values({_quote(tag)}, {max_id}, {step}, {_quote(description)})"
        )

    def fetch(self, tag: str, step: int | None = None) -> range:
        """One segment fetch of a Leaf server, with Leaf's own statements; returns the IDs it grants.

        ``IDAllocMapper.updateMaxId`` (the row's step) or ``updateMaxIdByCustomStep`` (the adapted
        step), then ``getLeafAlloc``; ``SegmentIDGenImpl.updateSegmentFromDb`` then hands out
        ``[max_id - step, max_id)``.
        """
        increment = "step" if step is None else str(step)
        out = self.sql(
            f"UPDATE leaf_alloc SET max_id = max_id + {increment} WHERE biz_tag = {_quote(tag)};\n"
            f"SELECT max_id, step FROM leaf_alloc WHERE biz_tag = {_quote(tag)};"
        )
        max_id, row_step = (int(v) for v in out.split())
        used = row_step if step is None else step
        return range(max_id - used, max_id)

    def max_id(self, tag: str) -> int:
        """The row's ``max_id``."""
        return int(self.sql(f"SELECT max_id FROM leaf_alloc WHERE biz_tag = {_quote(tag)}").strip())

    def snapshot(self) -> str:
        """Every row, for checking that nothing changed."""
        return self.sql(
            "SELECT biz_tag, max_id, step, description, update_time FROM leaf_alloc ORDER BY biz_tag"
        )
