"""Released migrations keep their SQL byte for byte, however schema.py builds the text."""

from __future__ import annotations

import hashlib

from dispenser.adapters.postgres.schema import MIGRATIONS

RELEASED = {
    1: "8d126dd05379a749b7dd213e83edf14839019b7ad47cb953b9ebb50124d4b905",
    2: "307402e263d0c6cb91e410b20b2fae36e2d60331d15446fe016661da2c5e83a9",
    3: "666c37cc2a515daab832be9cc5c989383b3ef2577771b3f71c39aecef0cdcf76",
    4: "bb073f79a022774f35c17ba8f8f52ccfb2d056143b47feb99dc9442a3761cf8d",
    5: "2a383bb90a2235a84bbab7c6015391fb273dbb234f4b1228024ce5525e739a27",
    6: "ef630ad51df21fc2fcf4f86f7504e0db4b2b69bad738ae79a54760ff8134abec",
    7: "ee40add389a20b6d6c1788df2e5452708d0d12656b24befb0ae9abac88ac2740",
    8: "06429e01618a519a763806131d9a7641bc35421c98cebd90b87f76b6f831226c",
    9: "baed1c82c5e62f74c8ee126c6eeb9f58e44bf9bc62def235ce70c84f8680e769",
    10: "26ae2fd6a04fdcaa682875cfcdcfb91af6306dcc2ad9fdd16dc7ef1a368fae0b",
}
"""sha256 of each released migration's SQL: an applied migration never runs again, so a changed text would
leave existing databases unlike new ones. Append the next version's hash once it is released."""


def test_released_migrations_keep_their_sql() -> None:
    texts = {m.version: hashlib.sha256(m.sql.encode()).hexdigest() for m in MIGRATIONS}
    assert {v: texts.get(v) for v in RELEASED} == RELEASED


def test_the_per_tag_tables_drop_their_rows_with_the_tag() -> None:
    """Versions 8-10 each drop their table's rows on DELETE, rename and TRUNCATE of leaf_alloc."""
    by_version = {m.version: m.sql for m in MIGRATIONS}
    for version, table, name in (
        (8, "dispenser_returned_range", "returned_ranges"),
        (9, "dispenser_tag_ordered", "ordered"),
        (10, "dispenser_tag_permuted", "permuted"),
    ):
        sql = by_version[version]
        assert f"DELETE FROM {table} WHERE biz_tag = OLD.biz_tag;" in sql
        assert f"CREATE TRIGGER dispenser_drop_{name} AFTER DELETE ON leaf_alloc" in sql
        assert f"CREATE TRIGGER dispenser_drop_renamed_{name} AFTER UPDATE OF biz_tag ON leaf_alloc" in sql
        assert f"CREATE TRIGGER dispenser_drop_truncated_{name} BEFORE TRUNCATE ON leaf_alloc" in sql
