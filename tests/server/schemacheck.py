"""A small JSON Schema checker for the server's OpenAPI document: the keywords FastAPI's
schemas use ($ref, type, properties, required, additionalProperties, items, anyOf,
oneOf, allOf, enum, const). Not jsonschema: the project does not depend on it."""
from __future__ import annotations

from typing import Any

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is(value: Any, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[name])


def problems(value: Any, schema: dict, doc: dict, where: str = "$") -> list[str]:
    """Every way `value` breaks `schema` (refs resolve in `doc`); [] when it conforms."""
    if "$ref" in schema:
        node: Any = doc
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        return problems(value, node, doc, where)
    out: list[str] = []
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is(value, t) for t in types):
            return [f"{where}: {value!r:.60} is not {schema['type']}"]
    if "const" in schema and value != schema["const"]:
        out.append(f"{where}: {value!r:.60} != {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{where}: {value!r:.60} not in {schema['enum']}")
    for sub in schema.get("allOf", []):
        out += problems(value, sub, doc, where)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            matches = [s for s in schema[key] if not problems(value, s, doc, where)]
            if not matches or (key == "oneOf" and len(matches) > 1):
                out.append(f"{where}: {value!r:.60} matches {len(matches)} of {key}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out += [f"{where}: {k!r} is missing" for k in schema.get("required", []) if k not in value]
        extra = schema.get("additionalProperties", True)
        for k, v in value.items():
            if k in props:
                out += problems(v, props[k], doc, f"{where}.{k}")
            elif extra is False:
                out.append(f"{where}: {k!r} is not in the schema")
            elif isinstance(extra, dict):
                out += problems(v, extra, doc, f"{where}.{k}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            out += problems(v, schema["items"], doc, f"{where}[{i}]")
    return out
