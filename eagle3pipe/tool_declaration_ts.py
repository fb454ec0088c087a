"""Tools declared the way Kimi-K2.5's tokenizer declares them: a TypeScript-style ``namespace functions``.

Kimi-K2.5's remote-code tokenizer renders an OpenAI ``tools`` list as TypeScript signatures (its sibling
``tool_declaration_ts.py``) and hands the text to the chat template as ``tools_ts_str``; the template puts it in
the ``tool_declare`` turn in place of the JSON. Written for this project from the published behaviour (no code
copied); ``eagle3pipe.toy`` copies this file beside ``tokenization_kimi.py`` into the release-shaped toy folder:

- ``# Tools\\n\\n## functions\\nnamespace functions {\\n`` + one block per function tool + ``}\\n`` (non-function
  tools are skipped; no function tool at all gives ``""``);
- a block: ``// description`` lines, then ``type NAME = (_: PARAMS) => any;``, preceded by ``interface`` lines for
  ``$defs`` (and ``interface parameters`` when the schema refers to itself with ``$ref: "#"``);
- an object: required fields first, then optional (``name?``), each group by name, one per line, two spaces per
  level, ``// description``, ``// constraint: value`` and ``// Default: value`` comments above a field;
  ``additionalProperties`` adds ``[k: string]: T``; integer is ``number``; enums are unions of literals.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger(__name__)

INDENT = "  "
# The JSON-schema keywords shown as a constraint comment, per type (others are not rendered).
CONSTRAINT_KEYS = {"string": ("maxLength", "minLength", "pattern"), "number": ("maximum", "minimum"),
                   "integer": ("maximum", "minimum"), "array": ("minItems", "maxItems")}
UNION_NAMES = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null",
               "object": "{}", "array": "Array<any>"}


def _comment(text: str, indent: str = "") -> str:
    """``text`` as ``//`` comment lines (an empty line stays empty, without indent)."""
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


class _Schemas:
    """``$defs`` met while walking one function's parameters, in the order met, and whether ``$ref: "#"`` was."""

    def __init__(self):
        self.defs: dict[str, Any] = {}
        self.self_ref = False

    def ref_name(self, ref: str) -> str:
        if ref == "#":
            self.self_ref = True
            return "parameters"
        if not ref.startswith("#/$defs/"):
            raise ValueError(f"unsupported $ref {ref!r}")
        name = ref.split("/")[-1]
        if name not in self.defs:
            raise ValueError(f"$ref {ref!r} names no $defs entry")
        return name


def _kind(schema) -> str:
    """Which rendering a schema gets (the first that applies, in this order)."""
    if isinstance(schema, bool):
        return "bool"
    if "$ref" in schema:
        return "ref"
    for key in ("anyOf", "enum"):
        if key in schema:
            return key
    if "type" in schema:
        t = schema["type"]
        return "union" if isinstance(t, list) else t if t in ("object", "array") else "scalar"
    if schema == {}:
        return "any"
    raise ValueError(f"not a JSON schema this renderer knows: {schema!r}")


def _doc(schema, indent: str) -> str:
    """Comment lines above a field or array item: its description, then its constraints (sorted by keyword)."""
    if isinstance(schema, bool):
        return ""
    lines = [_comment(schema["description"], indent)] if schema.get("description") else []
    keys = CONSTRAINT_KEYS.get(schema.get("type"), ()) if _kind(schema) in ("scalar", "array") else ()
    constraints = sorted((k, schema[k]) for k in keys if k in schema)
    if constraints:
        lines.append(indent + "// " + ", ".join(f"{k}: {v}" for k, v in constraints))
    return "".join(line + "\n" for line in lines)


def _type(schema, indent: str, schemas: _Schemas) -> str:
    """The TypeScript type of ``schema``, laid out for a field at ``indent``."""
    kind = _kind(schema)
    if kind == "bool":
        if not schema:
            log.warning("a false JSON schema is rendered as null")
        return "any" if schema else "null"
    if kind == "ref":
        return schemas.ref_name(schema["$ref"])
    if kind == "anyOf":
        return " | ".join(_type(s, indent, schemas) for s in schema["anyOf"])
    if kind == "enum":
        return " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in schema["enum"])
    if kind == "union":
        return " | ".join(UNION_NAMES[t] for t in schema["type"])
    if kind == "object":
        return _object(schema, indent, schemas)
    if kind == "array":
        item = schema.get("items") or {}
        doc = _doc(item, indent + INDENT)
        if doc:
            return f"Array<\n{doc}{indent}{INDENT}{_type(item, indent + INDENT, schemas)}\n{indent}>"
        return f"Array<{_type(item, indent, schemas)}>"
    if kind == "any":
        return "any"
    return "number" if schema["type"] == "integer" else schema["type"]


def _field(name: str, schema, optional: bool, indent: str, schemas: _Schemas) -> str:
    out = _doc(schema, indent)
    default = schema.get("default") if isinstance(schema, dict) else None
    if default is not None:
        shown = repr(default) if isinstance(default, (int, float, bool)) else json.dumps(default, ensure_ascii=False)
        out += f"{indent}// Default: {shown}\n"
    return out + f"{indent}{name}{'?' if optional else ''}: {_type(schema, indent, schemas)}"


def _fields(schema: dict, schemas: _Schemas) -> list[tuple[str, Any, bool]]:
    """(name, schema, optional) per property, in the schema's order; registers the object's ``$defs``."""
    schemas.defs.update(schema.get("$defs") or {})
    required = set(schema.get("required", []))
    return [(name, prop, name not in required) for name, prop in schema.get("properties", {}).items()]


def _object(schema: dict, indent: str, schemas: _Schemas) -> str:
    if not schema:
        return "{}"
    fields = _fields(schema, schemas)
    ordered = sorted(fields, key=lambda f: (f[2], f[0]))  # required first, then by name
    lines = [_field(n, s, opt, indent + INDENT, schemas) for n, s, opt in ordered]
    extra = schema.get("additionalProperties")
    if extra is not None:
        shown = ("any" if extra is True else "never" if extra is False else _type(extra, indent + INDENT, schemas))
        lines.append(f"{indent}{INDENT}[k: string]: {shown}")
    if not lines:
        return "{}"
    return "{\n" + ",\n".join(lines) + "\n" + indent + "}"


def _function(fn: dict) -> str:
    schemas = _Schemas()
    params = fn.get("parameters") or {}
    body = _object(params, "", schemas)
    interfaces = []
    if schemas.self_ref:  # the root refers to itself: it becomes an interface, fields in the schema's order
        lines = [_field(n, s, opt, INDENT, schemas) for n, s, opt in _fields(params, _Schemas())]
        interfaces.append("interface parameters {" + ("\n" + ",\n".join(lines) + "\n" if lines else "") + "}")
        body = "parameters"
    for name, definition in list(schemas.defs.items()):
        described = _comment(definition["description"]) + "\n" if definition.get("description") else ""
        interfaces.append(f"{described}interface {name} {_type(definition, '', schemas)}")
    parts = ["\n".join(interfaces), _comment(fn["description"]) if fn.get("description") else "",
             f"type {fn.get('name', 'function')} = (_: {body}) => any;"]
    return "\n".join(p for p in parts if p)


def encode_tools_to_typescript_style(tools: list[dict]) -> str:
    """The ``tools_ts_str`` Kimi-K2.5's template declares: OpenAI function tools as a TypeScript namespace."""
    functions = [_function(t["function"]) for t in tools or [] if t.get("type") == "function" and t.get("function")]
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"
