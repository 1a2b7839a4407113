"""A JSON schema the structured-output tests constrain answers to, and its check written out
by hand (no JSON Schema validator among the dependencies)."""

from __future__ import annotations

from typing import Any

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "color", "tags"],
    "additionalProperties": False,
}


def check_person(value: Any) -> None:
    """PERSON's constraints, checked by hand (no validator in the dependencies)."""
    assert isinstance(value, dict) and set(value) == set(PERSON["required"])
    assert isinstance(value["name"], str) and len(value["name"]) <= 8
    assert type(value["age"]) is int and 0 <= value["age"] <= 150
    assert type(value["ok"]) is bool
    assert value["color"] in ("red", "green", "blue")
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 2
    assert all(isinstance(t, str) and len(t) <= 3 for t in value["tags"])
