"""docs/asyncapi.yaml: generated from the code, valid AsyncAPI 3.0.0, and naming every subject, topic and header.

The AsyncAPI 3.0.0 JSON Schema is vendored in tests/data/ (see its README: the npm package
``@asyncapi/specs``, bundled with its bindings), so the check needs no network and no Node.js.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from dispenser.asyncapi import asyncapi_document, draft7, to_yaml
from dispenser.cli import main
from dispenser.messages import json_schemas

ROOT = Path(__file__).resolve().parents[2]
DOCUMENT = ROOT / "docs" / "asyncapi.yaml"
SCHEMA = ROOT / "tests" / "data" / "asyncapi-3.0.0.json"
SCHEMA_NOTE = ROOT / "tests" / "data" / "README.md"
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _load(text: str) -> Any:
    return yaml.load(text, Loader=LOADER)


def _document() -> dict[str, Any]:
    document = _load(DOCUMENT.read_text(encoding="utf-8"))
    assert isinstance(document, dict)
    return document


def _validator() -> jsonschema.Draft7Validator:
    """The AsyncAPI 3.0.0 schema; its definitions (bindings included) are resources of their own ``$id``."""
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    registry: Registry[Any] = Registry().with_resources(
        (uri, DRAFT7.create_resource(definition)) for uri, definition in schema["definitions"].items()
    )
    return jsonschema.Draft7Validator(schema, registry=registry)


def _errors(document: dict[str, Any]) -> list[str]:
    return [
        f"{'/'.join(map(str, error.absolute_path)) or '(top)'}: {error.message[:300]}"
        for error in _validator().iter_errors(document)
    ]


def _pointer(document: Any, ref: str) -> Any:
    node = document
    for part in ref.removeprefix("#/").split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [ref for value in node.values() for ref in _refs(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in _refs(value)]
    return []


# ---------------------------------------------------------------------------------------------------------


def test_vendored_schema_is_the_one_noted() -> None:
    """tests/data/asyncapi-3.0.0.json is byte for byte the file its README names (digest), and a valid schema."""
    note = SCHEMA_NOTE.read_text(encoding="utf-8").split("## asyncapi-3.0.0.json", 1)[1]
    digest = re.search(r"sha256: `([0-9a-f]{64})`", note)
    assert digest is not None, "tests/data/README.md must give the AsyncAPI schema's sha256"
    assert hashlib.sha256(SCHEMA.read_bytes()).hexdigest() == digest.group(1)
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    assert schema["$id"] == "http://asyncapi.com/definitions/3.0.0/asyncapi.json"
    jsonschema.Draft7Validator.check_schema(schema)


def test_document_is_what_the_code_generates() -> None:
    """docs/asyncapi.yaml says what the code generates (run `dispenser schemas` after changing a message or a name).

    Compared as data, as a YAML reader (PyYAML) reads the file; `dispenser schemas --check` compares the text
    (written by to_yaml, the same on every machine).
    """
    assert _document() == json.loads(json.dumps(asyncapi_document()))
    assert "&id0" not in DOCUMENT.read_text(encoding="utf-8"), "a value repeated is written out, not aliased"


def test_schemas_check_reports_a_stale_asyncapi_document(tmp_path: Path) -> None:
    """`dispenser schemas --check` fails when the AsyncAPI document differs from the code, then passes."""
    target = ["--dir", str(tmp_path / "schemas"), "--asyncapi", str(tmp_path / "asyncapi.yaml")]
    assert main(["schemas", *target]) == 0
    stale = tmp_path / "asyncapi.yaml"
    stale.write_text(stale.read_text().replace("leaf.requests", "leaf.request"))
    assert main(["schemas", *target, "--check"]) == 1
    assert main(["schemas", *target]) == 0
    assert main(["schemas", *target, "--check"]) == 0


def test_schemas_needs_no_yaml_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`dispenser schemas` writes and checks the AsyncAPI YAML from the base install: no PyYAML imported."""
    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` now raises ImportError
    target = ["--dir", str(tmp_path / "schemas"), "--asyncapi", str(tmp_path / "asyncapi.yaml")]
    assert main(["schemas", *target]) == 0
    assert main(["schemas", *target, "--check"]) == 0
    assert (tmp_path / "asyncapi.yaml").read_text(encoding="utf-8") == DOCUMENT.read_text(encoding="utf-8")


def test_document_is_valid_asyncapi_3() -> None:
    """The document validates against the official AsyncAPI 3.0.0 JSON Schema."""
    document = _document()
    assert document["asyncapi"] == "3.0.0"
    assert _errors(document) == []


def test_the_validation_has_teeth() -> None:
    """Mistakes the schema must catch: an unknown action, a misspelt key, a Kafka binding of no version."""
    document = _document()
    breakages: list[tuple[str, object]] = [
        ("operations/serveSegmentIds/action", "consume"),
        ("channels/segmentIds/adress", "leaf.segment.{tag}"),
        ("components/messages/kafkaIdRequest/bindings", {"kafka": {"bindingVersion": "9.9.9"}}),
        ("operations/serveKafkaRequests/reply/address", {"description": "no location"}),
    ]
    for where, value in breakages:
        broken = copy.deepcopy(document)
        *path, key = where.split("/")
        node = broken
        for part in path:
            node = node[part]
        node[key] = value
        assert _errors(broken), f"{where} = {value!r} passed"


def test_every_reference_resolves() -> None:
    """Every local $ref points at something in the document (the schema does not check that)."""
    document = _document()
    refs = _refs(document)
    assert len(refs) > 40
    for ref in refs:
        assert ref.startswith("#/"), f"{ref}: the document must stand alone"
        _pointer(document, ref)
    for name, operation in document["operations"].items():
        channel = operation["channel"]["$ref"]
        reply = operation.get("reply", {})
        for message in reply.get("messages", []):
            assert message["$ref"].startswith(reply["channel"]["$ref"] + "/messages/"), name
        for message in operation.get("messages", []):
            assert message["$ref"].startswith(channel + "/messages/"), name


def test_payload_schemas_are_those_of_schemas_dir() -> None:
    """Each wire message's schema in the document is its schemas/*.schema.json, references moved to components.

    (In draft-07, AsyncAPI's dialect: tuples are written as ``items`` lists, see ``dispenser.asyncapi.draft7``.)
    """
    components = _document()["components"]["schemas"]
    for name in json_schemas():
        schema = json.loads((ROOT / "schemas" / name).read_text(encoding="utf-8"))
        text = json.dumps(schema["$defs"]).replace('"#/$defs/', '"#/components/schemas/')
        for type_name, definition in json.loads(text).items():
            assert components[type_name] == draft7(definition), f"{name}: {type_name}"
    assert "prefixItems" not in json.dumps(components)


def test_draft7_keeps_a_tuple_a_tuple() -> None:
    """A msgspec tuple schema read as draft-07 accepts a pair and rejects what 2020-12 would reject."""
    schema = draft7(
        {"type": "array", "prefixItems": [{"type": "integer"}] * 2, "items": False, "minItems": 2}
    )
    validator = jsonschema.Draft7Validator(schema)
    assert validator.is_valid([1, 2])
    assert not validator.is_valid([1, 2, 3])
    assert not validator.is_valid([1, "2"])


def test_examples_match_their_payload_schemas() -> None:
    """Every message example's payload validates against the message's payload schema, read as draft-07."""
    document = _document()
    root = Resource.from_contents(document, default_specification=DRAFT7)
    registry: Registry[Any] = Registry().with_resource("urn:asyncapi", root)
    seen = 0
    for name, message in document["components"]["messages"].items():
        for sample in message.get("examples", []):
            payload = message["payload"]
            validator = jsonschema.Draft7Validator(
                {"$ref": "urn:asyncapi" + payload["$ref"]} if "$ref" in payload else payload,
                registry=registry,
            )
            errors = [error.message for error in validator.iter_errors(sample["payload"])]
            assert errors == [], f"{name}: {sample.get('name', '')}"
            seen += 1
    assert seen >= 5


def test_every_subject_topic_and_header_is_described() -> None:
    """The subjects and topics of the default configuration, and the headers the workers read and write."""
    document = _document()
    addresses = {channel["address"] for channel in document["channels"].values()}
    assert addresses == {
        "leaf.segment.{tag}",
        "leaf.snowflake.{tag}",
        "leaf.snowflake.decode",
        "leaf.rate.{tag}",
        "leaf.snowflake-clock",
        "leaf.segment-residue",
        "leaf.segment-residue-check",
        None,  # NATS replies go to the requester's inbox
        "leaf.requests",
        "leaf.replies",
        "leaf.rate",
        "{input}",
        "{output}",
        "{input}.dlq",
    }
    messages = document["components"]["messages"]

    def headers(message: str) -> set[str]:
        return set(messages[message].get("headers", {}).get("properties", {}))

    assert headers("reply") == {"Nats-Service-Error", "Nats-Service-Error-Code", "Content-Type"}
    assert headers("kafkaIdRequest") == {
        "kafka_replyTopic",
        "kafka_replyPartition",
        "kafka_correlationId",
        "content-type",
    }
    assert headers("kafkaReply") == {"kafka_correlationId", "leaf-error-code", "content-type"}
    assert headers("enrichedRecord") == {"leaf-source"}
    assert headers("deadLetter") == {
        "leaf-error-code",
        "leaf-error-message",
        "leaf-source-topic",
        "leaf-source-partition",
        "leaf-source-offset",
        "leaf-source",
    }
    codes = messages["deadLetter"]["headers"]["properties"]["leaf-error-code"]["enum"]
    assert set(codes) == {"not_json", "not_an_object", "field_missing", "no_value", "too_large"}
    schemas = document["components"]["schemas"]
    assert set(schemas["IdRequest"]["properties"]) == {"count", "request_id", "format"}
    assert set(schemas["Reply"]["properties"]) == {
        "tag",
        "ids",
        "ranges",
        "error",
        "request_id",
        "permuted",
        "sqids",
    }
    assert set(schemas["ErrorBody"]["required"]) == {"code", "message", "retryable"}


@pytest.mark.parametrize("doc", ["protocol.md", "kafka.md"])
def test_the_docs_point_to_the_document(doc: str) -> None:
    """docs/protocol.md and docs/kafka.md send readers to asyncapi.yaml."""
    assert "asyncapi.yaml" in (ROOT / "docs" / doc).read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------
# the writer (to_yaml, no YAML library: what it writes, PyYAML reads back exactly)

_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text()
    | st.sampled_from(
        ["yes", "No", "null", "~", "1e3", "0x1F", "-", "a: b", "#c", "'q'", "2026-11-25", "$ref"]
    )
)
_json = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4)
)


# Found by Hypothesis: a key with a line break (the hand-written emitter before PyYAML), NEL, LS and PS
# (PyYAML writes them raw in single quotes and reads them back as spaces). Then the writer's own edges:
# a key too long for a simple key, long strings folded (at single spaces only; double spaces, trailing
# spaces, a backslash before a space), floats without a dot, YAML 1.1's booleans, a byte-order mark.
@example({"A\n": None})
@example({"\x85": None})
@example({"a": "x\u2028y", "b": ["\u2029"]})
@example({"k" * 1500: {"nested": ["x" * 1200]}, "q" * 1200: 1, "short": "y" * 2000})
@example({"d": "word " * 40 + " two  spaces " * 10 + "end ", "e": ["\\ " * 60, [" lead " * 30]]})
@example([1e20, -1e-05, 2.5, 0.0, -0.0, 1e300, 12345678901234567890])
@example({"yes": "No", "on": "OFF", "y": "n", "null": "~", "3.0.0": "0.1.0", "1:20": "2026-11-25"})
@example({"\ufeffbom": "\ufeff", "tab\t": "a\tb", "nul\0": "\x7f\x9f\ue000\U0010ffff"})
@given(st.dictionaries(st.text(), _json, max_size=5) | st.lists(_json, max_size=5))
def test_yaml_round_trips(value: dict[str, Any] | list[Any]) -> None:
    """to_yaml writes any JSON-like value so that a YAML reader gets exactly it back."""
    assert _load(to_yaml(value)) == value
