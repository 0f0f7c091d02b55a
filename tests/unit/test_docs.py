"""The README and docs/ say only true things, where a test can tell.

* every setting in docs/configuration.md (and the ``[rate]`` table in docs/operations.md) and in the
  README's settings table exists in :class:`dispenser.config.Config`, every ``Config`` field is documented,
  and a default the tables state as a literal is the real default;
* every ``dispenser …`` command line in a shell code block (and in ``dispenser --help``'s examples) parses
  with the real argparse parser, and every ``dispenser <command>`` named in running text is a real one;
* every relative link points to a file of the repository (and to a heading there, when it names one), and
  every repository path quoted in backticks exists;
* the metrics table in docs/operations.md lists exactly the metrics dispenser/adapters/prometheus.py exposes.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fnmatch
import io
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from dispenser import cli
from dispenser.config import Config
from dispenser_lab.bench import nats_bench

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONFIGURATION = ROOT / "docs" / "configuration.md"
OPERATIONS = ROOT / "docs" / "operations.md"
METRICS_SOURCE = ROOT / "dispenser" / "adapters" / "prometheus.py"

# Code blocks whose lines are commands a reader would type (```text blocks are program output).
SHELL_LANGUAGES = {"", "sh", "bash", "shell", "console"}
_BACKTICKED = re.compile(r"`([^`]+)`")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_PARENT = re.compile(r"(?<![.\w])\.\./")  # ../shared, not the ellipsis in .../temporary/
_MARKDOWN_NAME = re.compile(r"(?<![\w/.-])([\w-]+\.md)\b")
_REPO_PATH = re.compile(r"`((?:compose|deploy|dispenser|docs|schemas|scripts|tests|tools)/[A-Za-z0-9_./-]+)`")


# ---------------------------------------------------------------------------------------------------------
# Markdown, read just well enough for these checks


@dataclass(frozen=True)
class Line:
    """One line of a Markdown file, with where it sits."""

    path: Path
    number: int
    text: str
    heading: str
    """The text of the nearest heading above (any level)."""
    code: str | None
    """The code block's language (``""`` when it names none) when the line is inside one, else None."""


def _lines(path: Path) -> Iterator[Line]:
    heading = ""
    code: str | None = None
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = text.strip()
        if stripped.startswith("```"):
            code = stripped[3:].strip() if code is None else None
            continue
        if code is None and (match := _HEADING.match(text)):
            heading = match.group(2)
        yield Line(path, number, text, heading, code)


def _cells(row: str) -> list[str]:
    """Split a table row on the pipes that are not inside backticks."""
    cells: list[str] = []
    current: list[str] = []
    in_code = False
    for char in row.strip().strip("|"):
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            cells.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    cells.append("".join(current).strip())
    return cells


@dataclass(frozen=True)
class Table:
    """A Markdown table: its heading, header cells and body rows (each with its line number)."""

    path: Path
    heading: str
    header: list[str]
    rows: list[tuple[int, list[str]]]


def _tables(path: Path) -> list[Table]:
    tables: list[Table] = []
    block: list[Line] = []
    for line in [*_lines(path), None]:
        if line is not None and line.code is None and line.text.lstrip().startswith("|"):
            block.append(line)
            continue
        if len(block) >= 2:
            rows = [(row.number, _cells(row.text)) for row in block[2:]]  # [1] is the |---| separator
            tables.append(Table(path, block[0].heading, _cells(block[0].text), rows))
        block = []
    return tables


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


# ---------------------------------------------------------------------------------------------------------
# (a) settings


def _real_settings() -> dict[str, dict[str, object]]:
    """Every setting's default, by section and name, read from a default ``Config``."""
    config = Config()
    return {section: msgspec.structs.asdict(getattr(config, section)) for section in Config.__struct_fields__}


SETTINGS = _real_settings()
_SECTION_HEADING = re.compile(r"`\[(\w+)\]`")


@dataclass(frozen=True)
class Documented:
    """A default as a table states it, for one setting."""

    where: str
    section: str
    name: str
    default: str


def _default_parts(cell: str, count: int, where: str) -> list[str]:
    """The cell's default for each of ``count`` names: ``a`` / ``b`` and ``a``, ``b`` give one each."""
    if count == 1:
        return [cell]
    for separator in (" / ", ", "):
        parts = [part.strip() for part in _split_outside_backticks(cell, separator)]
        if len(parts) == count:
            return parts
    # One value for all of them ("none") is fine; several values that do not pair up are not.
    assert len(_BACKTICKED.findall(cell)) <= 1, f"{where}: {count} settings, defaults {cell!r} do not pair up"
    return [cell] * count


def _split_outside_backticks(text: str, separator: str) -> list[str]:
    parts, start, in_code, i = [], 0, False, 0
    while i < len(text):
        if text[i] == "`":
            in_code = not in_code
        elif not in_code and text.startswith(separator, i):
            parts.append(text[start:i])
            start = i + len(separator)
            i = start
            continue
        i += 1
    parts.append(text[start:])
    return parts


def _reference_tables() -> list[Documented]:
    """The ``name | default | meaning`` tables of docs/configuration.md and the ``[rate]`` one of operations.md."""
    documented = []
    for table in [*_tables(CONFIGURATION), *_tables(OPERATIONS)]:
        section = _SECTION_HEADING.search(table.heading)
        if section is None or table.header[:2] != ["name", "default"]:
            continue
        for number, cells in table.rows:
            where = f"{table.path.name}:{number}"
            names = _BACKTICKED.findall(cells[0])
            for name, default in zip(names, _default_parts(cells[1], len(names), where), strict=True):
                documented.append(Documented(where, section.group(1), name, default))
    return documented


def _readme_table() -> list[tuple[Documented, list[str]]]:
    """The README's ``setting | environment | default`` rows: each setting, with the row's variables."""
    documented: list[tuple[Documented, list[str]]] = []
    for table in _tables(ROOT / "README.md"):
        if table.header[:3] != ["setting", "environment", "default"]:
            continue
        for number, cells in table.rows:
            where = f"README.md:{number}"
            tokens = _BACKTICKED.findall(cells[0])
            assert "." in tokens[0], f"{where}: the first setting must be section.name, got {tokens[0]!r}"
            section = tokens[0].split(".")[0]
            names = []
            for token in tokens:
                token_section, _, name = token.rpartition(".")
                assert token_section in ("", section), f"{where}: {token!r} mixes sections in one row"
                # `tls_*` stands for every field it matches.
                matches = fnmatch.filter(SETTINGS.get(section, {}), name) if "*" in name else [name]
                assert matches, f"{where}: {section}.{name} matches no setting"
                names.extend(matches)
            defaults = _default_parts(cells[2], len(tokens), where)
            if len(names) > len(tokens):  # a pattern row: one default for all of them
                defaults = [cells[2]] * len(names)
            envs = _BACKTICKED.findall(cells[1])
            documented.extend(
                (Documented(where, section, name, default), envs)
                for name, default in zip(names, defaults, strict=True)
            )
    return documented


def _literal(default: str) -> str | None:
    """The literal a default cell states (its leading backticked value, or ``none``), or None for prose."""
    if default.lower().startswith("none"):
        return "none"
    match = re.match(r"`([^`]*)`", default)
    return match.group(1) if match else None


def _check_default(item: Documented) -> None:
    real = SETTINGS[item.section][item.name]
    literal = _literal(item.default)
    setting = f"{item.where}: {item.section}.{item.name}"
    if literal is None:
        return  # prose: "the group ID", "an identity kept in the state dir"
    if literal == "none":
        assert real is None, f"{setting} is documented as none but defaults to {real!r}"
    elif real is None:
        return  # unset means "derived": the doc gives what it is derived as (`leaf-enrich.<input topic>`)
    elif isinstance(real, bool):
        assert literal == str(real).lower(), f"{setting}: documented {literal!r}, real {real!r}"
    elif isinstance(real, int | float):
        number = float(literal.replace(",", "").replace("_", ""))
        assert number == real, f"{setting}: documented {literal!r}, real {real!r}"
    else:
        assert literal == real, f"{setting}: documented {literal!r}, real {real!r}"


def test_every_documented_setting_exists_with_its_real_default() -> None:
    """Each setting of the reference tables is a Config field, and a literal default is the real one."""
    documented = _reference_tables()
    assert len(documented) > 50  # the tables were found
    for item in documented:
        assert item.name in SETTINGS.get(item.section, {}), (
            f"{item.where}: no setting {item.section}.{item.name}"
        )
        _check_default(item)


def test_every_setting_is_documented_in_the_reference() -> None:
    """Each Config field has a row in a reference table, and configuration.md names it in its section."""
    tabled = {(item.section, item.name) for item in _reference_tables()}
    real = {(section, name) for section, fields in SETTINGS.items() for name in fields}
    assert sorted(real - tabled) == [], "settings without a row in docs/configuration.md (or operations.md)"
    named: dict[str, set[str]] = {}
    section = None
    for line in _lines(CONFIGURATION):
        match = _SECTION_HEADING.search(line.heading)
        section = match.group(1) if match else None
        if section is not None:
            named.setdefault(section, set()).update(_BACKTICKED.findall(line.text))
    missing = sorted(
        f"{s}.{n}" for s, fields in SETTINGS.items() for n in fields if n not in named.get(s, ())
    )
    assert missing == [], "settings that docs/configuration.md does not name under their [section]"


def test_readme_settings_table_matches_config() -> None:
    """The README's common settings exist, their variables are theirs, and literal defaults are real."""
    rows = _readme_table()
    assert len(rows) > 20
    for item, _ in rows:
        assert item.name in SETTINGS.get(item.section, {}), (
            f"{item.where}: no setting {item.section}.{item.name}"
        )
        _check_default(item)
    by_row: dict[str, list[tuple[Documented, list[str]]]] = {}
    for item, envs in rows:
        by_row.setdefault(item.where, []).append((item, envs))
    for where, items in by_row.items():
        section = items[0][0].section
        row_envs = {f"DISPENSER_{item.section}_{item.name}".upper() for item, _ in items}
        for env in items[0][1]:
            # `…_MODE` abbreviates the row's section prefix; `DISPENSER_KAFKA_…` stands for the whole row.
            full = f"DISPENSER_{section.upper()}{env[1:]}" if env.startswith("…") else env
            if full.endswith("…"):
                assert all(e.startswith(full[:-1]) for e in row_envs), (
                    f"{where}: {env} is not this row's prefix"
                )
            else:
                assert full in row_envs, f"{where}: {env} is not the variable of {sorted(row_envs)}"


# ---------------------------------------------------------------------------------------------------------
# (b) command lines


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _variants(line: str) -> list[str]:
    """The line with its ``[optional]`` parts left out, and with each one (each ``a | b`` choice) put in."""
    optional = re.compile(r"\s*\[([^\[\]]*)\]")
    variants = [optional.sub("", line)]
    for index, group in enumerate(optional.findall(line)):
        for choice in group.split(" | "):
            variants.append(_keep_one(optional, line, index, choice))
    return variants


def _keep_one(optional: re.Pattern[str], line: str, index: int, choice: str) -> str:
    """``line`` with the ``index``-th optional part replaced by ``choice`` and the others left out."""
    counter = iter(range(1_000))

    def replace(_match: re.Match[str]) -> str:
        return f" {choice}" if next(counter) == index else ""

    return optional.sub(replace, line)


def _argv(command: str) -> list[str] | None:
    """The arguments after ``dispenser`` in a shell line (placeholders made concrete), or None."""
    command = re.sub(r"<[^<>]*>", "1", command)  # <a snowflake ID>
    words = shlex.split(command, comments=True)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value dispenser …
        words.pop(0)
    if not words or not (words[0] == "dispenser" or words[0].endswith("/dispenser")):
        return None
    # Upper-case words are placeholders (ID, T, X, N): any value of the right type will do.
    return ["1" if re.fullmatch(r"[A-Z][A-Z0-9]*", word) else word for word in words[1:]]


def _shell_commands() -> list[tuple[str, str]]:
    commands = []
    for path in DOCS:
        for line in _lines(path):
            if line.code in SHELL_LANGUAGES and re.match(r"\s*(\S*/)?dispenser\s", line.text):
                commands.append((f"{path.relative_to(ROOT)}:{line.number}", line.text.strip()))
    # `dispenser --help` shows examples too.
    for number, text in enumerate(cli.EPILOG.splitlines(), 1):
        if re.match(r"\s*(\S+=\S+\s+)*dispenser\s", text):
            commands.append((f"cli.EPILOG:{number}", text.strip()))
    return commands


COMMANDS = _shell_commands()


def test_shell_examples_were_found() -> None:
    """The README's own examples are among the command lines checked (the extraction works)."""
    assert len(COMMANDS) > 20
    assert any(text.startswith("dispenser tag add order") for _, text in COMMANDS)


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[where for where, _ in COMMANDS])
def test_documented_command_parses(where: str, command: str) -> None:
    """Every variant of the command line parses with the CLI's parser (and ``bench nats`` with its own)."""
    for variant in _variants(command):
        argv = _argv(variant)
        assert argv is not None, f"{where}: not a dispenser command: {variant!r}"
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors):
                args = cli._parser().parse_args(argv)
                if args.command == "bench" and args.target == "nats":
                    nats_bench.parse_options(args.options)
        except SystemExit:
            pytest.fail(
                f"{where}: `dispenser {shlex.join(argv)}` does not parse: {errors.getvalue().strip()}"
            )


def test_commands_named_in_text_exist() -> None:
    """``dispenser <command>`` (and ``dispenser bench <target>``, ``dispenser tag <action>``) in running text."""
    parser = cli._parser()
    commands = _subcommands(parser)
    seen = 0
    for path in DOCS:
        for line in _lines(path):
            if line.code is not None:
                continue
            for span in _BACKTICKED.findall(line.text):
                words = span.split()
                if len(words) < 2 or words[0] != "dispenser" or words[1].startswith("-"):
                    continue
                seen += 1
                where = f"{path.relative_to(ROOT)}:{line.number}"
                assert words[1] in commands, f"{where}: `{span}`: no command {words[1]!r}"
                actions = _subcommands(commands[words[1]])
                if actions and len(words) > 2 and not words[2].startswith("-"):
                    assert words[2] in actions, f"{where}: `{span}`: no {words[1]} {words[2]!r}"
                if words[1] == "bench" and len(words) > 2:
                    bench = next(a for a in commands["bench"]._actions if a.dest == "target")
                    assert bench.choices is not None
                    assert words[2] in bench.choices, f"{where}: `{span}`: no benchmark {words[2]!r}"
    assert seen > 10


# ---------------------------------------------------------------------------------------------------------
# (c) links and paths


def _anchors(path: Path) -> set[str]:
    return {
        _slug(match.group(2))
        for line in _lines(path)
        if line.code is None and (match := _HEADING.match(line.text))
    }


def test_relative_links_point_into_the_repository() -> None:
    """Every link that is not a web address names a file of the repository (and a heading of it)."""
    checked = 0
    for path in DOCS:
        for line in _lines(path):
            if line.code is not None:
                continue
            for target in _LINK.findall(line.text):
                where = f"{path.relative_to(ROOT)}:{line.number}: {target}"
                if target.startswith(("https://", "http://")):
                    continue
                assert ":" not in target.split("#")[0], f"{where}: only web addresses and relative paths"
                file_part, _, anchor = target.partition("#")
                resolved = (path.parent / file_part).resolve() if file_part else path
                assert resolved.is_relative_to(ROOT), f"{where}: outside the repository"
                assert resolved.exists(), f"{where}: no such file"
                if anchor and resolved.suffix == ".md":
                    assert anchor in _anchors(resolved), f"{where}: no heading #{anchor}"
                checked += 1
    assert checked > 10


def test_quoted_repository_paths_exist() -> None:
    """A repository path in backticks (``docs/kafka.md``) or a ``*.md`` named exists; none is outside."""
    for path in DOCS:
        for line in _lines(path):
            where = f"{path.relative_to(ROOT)}:{line.number}"
            outside = [span for span in _BACKTICKED.findall(line.text) if _PARENT.search(span)]
            assert outside == [], f"{where}: a path outside the repository"
            if line.code is not None:
                continue
            for quoted in _REPO_PATH.findall(line.text):
                assert (ROOT / quoted).exists(), f"{where}: `{quoted}` does not exist"
            # A document named in passing ("the targets from DESIGN.md") must be one a reader can open.
            for name in _MARKDOWN_NAME.findall(re.sub(r"https?://\S+", "", line.text)):
                places = (path.parent / name, ROOT / name, ROOT / "docs" / name)
                assert any(place.exists() for place in places), f"{where}: no {name} in the repository"


# ---------------------------------------------------------------------------------------------------------
# (d) metrics


def _exposed_metrics() -> set[str]:
    """The names /metrics shows: each *MetricFamily's name, counters with Prometheus' ``_total``."""
    names = set()
    for node in ast.walk(ast.parse(METRICS_SOURCE.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        kind = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        first = node.args[0]
        if kind.endswith("MetricFamily") and isinstance(first, ast.Constant) and isinstance(first.value, str):
            names.add(first.value + ("_total" if kind.startswith("Counter") else ""))
    return names


def test_metrics_table_matches_the_collector() -> None:
    """docs/operations.md's metrics table names exactly the metrics the collector exposes."""
    documented: set[str] = set()
    for table in _tables(OPERATIONS):
        if table.header[:1] == ["metric"]:
            for _, cells in table.rows:
                documented.update(name for name in _BACKTICKED.findall(cells[0]) if name.startswith("leaf_"))
    exposed = _exposed_metrics()
    assert len(exposed) > 10
    assert sorted(documented - exposed) == [], "documented metrics that prometheus.py does not expose"
    assert sorted(exposed - documented) == [], "exposed metrics missing from the docs/operations.md table"
