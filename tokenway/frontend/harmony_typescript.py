"""A tool's JSON schema as Harmony writes it in the developer message: the TypeScript-like type
of `namespace functions { type NAME = (_: TYPE) => any; }`, character for character as
openai-harmony renders it (its json_schema_to_typescript), since that is what gpt-oss read in
training:

    {"type": "object", "properties": {"location": {"type": "string", "description": "The city"},
     "unit": {"type": "string", "enum": ["c", "f"], "default": "c"}}, "required": ["location"]}
    ->
    {
    // The city
    location: string,
    unit?: "c" | "f", // default: c
    }

Descriptions, titles and examples become comments above a property, a default a comment after
it (a string default quoted unless the property is an enum), `oneOf` a union one variant a line,
`nullable` a `| null`, integers `number`, anything unknown `any`.
"""

from __future__ import annotations

import json
from typing import Any


def schema_type(schema: Any, indent: str = "") -> str:
    """`schema` (a JSON schema as sent) as Harmony's TypeScript-like type."""
    if not isinstance(schema, dict):
        return "any"
    one_of = schema.get("oneOf")
    if isinstance(one_of, list):
        return "".join(_variant(variant, indent, _trailing(variant, None, json_enum_default=True))
                       for variant in one_of)
    kinds = schema.get("type")
    if isinstance(kinds, list):
        names = ["number" if kind == "integer" else kind for kind in kinds if isinstance(kind, str)]
        if names:
            return " | ".join(names)
    if not isinstance(kinds, str):
        return "any"
    if kinds == "object":
        return _object(schema, indent)
    if kinds == "string":
        enum = [f'"{value}"' for value in schema.get("enum") or () if isinstance(value, str)] \
            if isinstance(schema.get("enum"), list) else []
        return " | ".join(enum) if enum else "string"
    if kinds in ("number", "integer"):
        return "number"
    if kinds == "boolean":
        return "boolean"
    if kinds == "array":
        return f"{schema_type(schema['items'], indent)}[]" if "items" in schema else "Array<any>"
    return "any"


def _object(schema: dict, indent: str) -> str:
    lines = []
    description = schema.get("description")
    head = f"{indent}// {description}\n{{\n" if isinstance(description, str) else "{\n"
    properties = schema.get("properties")
    required = {name for name in schema.get("required") or () if isinstance(name, str)} \
        if isinstance(schema.get("required"), list) else set()
    for key, value in (properties.items() if isinstance(properties, dict) else ()):
        value = value if isinstance(value, dict) else {}
        optional = "" if key in required else "?"
        title = value.get("title")
        if isinstance(title, str):
            lines.append(f"{indent}// {title}\n{indent}//\n")
        one_of = value.get("oneOf")
        if "oneOf" not in value and isinstance(value.get("description"), str):
            lines.append(f"{indent}// {value['description']}\n")
        examples = value.get("examples")
        if isinstance(examples, list) and examples:
            lines.append(f"{indent}// Examples:\n")
            lines.extend(f'{indent}// - "{example}"\n' for example in examples if isinstance(example, str))
        if isinstance(one_of, list):
            lines.append(_one_of_property(key, optional, value, one_of, indent))
            continue
        line = f"{indent}{key}{optional}: {_nullable(value, schema_type(value, indent + '    '))},"
        if "default" in value and "oneOf" not in value:
            line += f" // {_default(value)}"
        lines.append(line + "\n")
    return head + "".join(lines) + f"{indent}}}"


def _one_of_property(key: str, optional: str, value: dict, one_of: list, indent: str) -> str:
    """A property whose schema is a oneOf: its comments above it, then a variant a line."""
    out = []
    description = value.get("description") if isinstance(value.get("description"), str) else None
    first = one_of[0] if one_of and isinstance(one_of[0], dict) else {}
    above = description is not None and first.get("description") != description
    if above:
        out.append(f"{indent}// {description}\n")
    if "default" in value:
        out.append(f"{indent}// {_default(value)}\n")
    out.append(f"{indent}{key}{optional}:\n")
    for position, variant in enumerate(one_of):
        skip = description if not (position == 0 and above) else _SKIP_ALL
        out.append(_variant(variant, indent, _trailing(variant, skip), leading="") + "\n")
    out.append(f"{indent},\n")
    return "".join(out)


_SKIP_ALL = object()  # the first variant's description when the property's own was written above it


def _variant(variant: Any, indent: str, trailing: list[str], leading: str = "\n") -> str:
    text = f"{leading}{indent} | " + _nullable(variant, schema_type(variant, indent + "   "))
    return text + (f" // {' '.join(trailing)}" if trailing else "")


def _trailing(variant: Any, skip: Any, json_enum_default: bool = False) -> list[str]:
    """A union variant's comments after it: its description (unless it is `skip`), its default
    (a top-level union writes an enum's string default as JSON, a property's bare)."""
    if not isinstance(variant, dict):
        return []
    comments = []
    description = variant.get("description")
    if isinstance(description, str) and skip is not _SKIP_ALL and description != skip:
        comments.append(description)
    if "default" in variant:
        default = variant["default"]
        comments.append(f"default: {json.dumps(default, ensure_ascii=False)}" if json_enum_default and
                        isinstance(default, str) and _is_enum(variant) else _default(variant))
    return comments


def _nullable(schema: Any, text: str) -> str:
    if isinstance(schema, dict) and schema.get("nullable") is True and "null" not in text:
        return f"{text} | null"
    return text


def _default(schema: dict) -> str:
    """`default: X` as Harmony writes it: a string quoted (bare for an enum), else its JSON."""
    default = schema["default"]
    if isinstance(default, str):
        return f"default: {default}" if _is_enum(schema) else f'default: "{default}"'
    return f"default: {json.dumps(default, ensure_ascii=False, separators=(',', ':'))}"


def _is_enum(schema: dict) -> bool:
    enum = schema.get("enum")
    return isinstance(enum, list) and bool(enum)
