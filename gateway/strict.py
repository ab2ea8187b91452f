"""`strict: true` on a JSON Schema (a `json_schema` response format, a function tool's parameters) as
OpenAI means it: every object is closed. An object schema that does not say which other keys it
allows (no `additionalProperties`) gets `additionalProperties: false`, so the model cannot add a key
the schema does not name; `required` stays as the schema gives it.

Without this, what Pydantic's `model_json_schema()` gives (objects with no `additionalProperties`)
leaves the grammar open, and a small model adds keys until max_tokens (docs/protocols.md).
"""

from __future__ import annotations

from typing import Any

from gateway.errors import invalid

# Keywords whose value is one subschema, or a list of them, or a map of names to them.
ONE = ("items", "additionalItems", "not", "if", "then", "else", "contains", "propertyNames")
LISTS = ("prefixItems", "anyOf", "oneOf")
MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def closed(schema: Any, field: str) -> Any:
    """A copy of `schema` with every object closed; a 400 naming `field` for a schema nested past
    what Python can walk."""
    try:
        return _close(schema)
    except RecursionError:
        raise invalid(field, "the schema is nested too deeply") from None


def _close(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ONE:
        if key in out:
            out[key] = _close(out[key])
    for key in LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_close(branch) for branch in out[key]]
    for key in MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(sub) for name, sub in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _close(out["additionalProperties"])
    # allOf's branches are left open: each one closed would refuse the keys the others add.
    if _is_object(out) and "additionalProperties" not in out and "allOf" not in out:
        out["additionalProperties"] = False
    return out


def _is_object(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    if kind == "object" or (isinstance(kind, list) and "object" in kind):
        return True
    return kind is None and "properties" in schema
