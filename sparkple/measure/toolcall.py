"""The quality gate's tool-call check: a reply's tool calls against the tools' JSON schemas (the
subset tool parameters use), each error saying where the arguments break it."""

from __future__ import annotations

import json
import math
from typing import Any


def schema_errors(value: Any, schema: dict[str, Any], where: str = "arguments") -> list[str]:
    """Where `value` breaks the JSON schema (the subset tool parameters use: type, properties,
    required, additionalProperties, enum, minimum/maximum, minLength/maxLength, items)."""
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    kind = schema.get("type")
    if kind in ("integer", "number"):
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if not numeric or (kind == "integer" and not float(value).is_integer()):
            return [f"{where} is {json.dumps(value)}, not an {kind}"]
        low, high = schema.get("minimum", -math.inf), schema.get("maximum", math.inf)
        if not low <= value <= high:
            return [f"{where} is {value}, outside [{low}, {high}]"]
    elif kind in kinds and not isinstance(value, kinds[kind]):
        return [f"{where} is {json.dumps(value)}, not of type {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where} is {json.dumps(value)}, not one of {schema['enum']}"]
    lengths = schema.get("minLength", 0), schema.get("maxLength", math.inf)
    if isinstance(value, str) and not lengths[0] <= len(value) <= lengths[1]:
        return [f"{where} has {len(value)} characters, outside the schema's lengths"]
    errors: list[str] = []
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errors += [
            f"{where} lacks {name}" for name in schema.get("required", []) if name not in value
        ]
        if schema.get("additionalProperties") is False:
            errors += [
                f"{where} has {name}, which the schema does not allow"
                for name in value
                if name not in props
            ]
        for name, sub in props.items():
            if name in value:
                errors += schema_errors(value[name], sub, f"{where}.{name}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{where}[{i}]")
    return errors


def tool_call_errors(reply: dict[str, Any], tools: list[dict[str, Any]]) -> list[str]:
    """Why the reply to the tool request does not parse against the tools' schemas ([]: it does)."""
    if "error" in reply:
        return [reply["error"]]
    if not reply.get("calls"):
        return [f"no tool call in the reply (finish reason {reply.get('finish_reason')})"]
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools}
    errors: list[str] = []
    for call in reply["calls"]:
        if call["name"] not in schemas:
            errors.append(f"it calls {call['name']!r}, not one of {sorted(schemas)}")
            continue
        try:
            arguments = json.loads(call["arguments"])
        except (TypeError, ValueError) as exc:
            errors.append(f"{call['name']}'s arguments are not JSON ({exc}): {call['arguments']!r}")
            continue
        errors += schema_errors(arguments, schemas[call["name"]], f"{call['name']}.arguments")
    return errors
