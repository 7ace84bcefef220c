"""Typing a tool call's text arguments by the tool's JSON schema (the tool-call parsers and the server).

XML-style tool calls carry every argument as text; the request's ``tools`` say what each should be.
:func:`convert_argument` reads the text as the schema's type the way Megatron-Core 0.19 (after
vLLM) does, and :func:`normalize_structured_arguments` is the server's second pass that turns JSON
text into arrays and objects wherever the schema allows them. Neither raises on odd model output,
and only JSON-serialisable values come back (a value that is not stays text).
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

__all__ = ["argument_schemas", "declared_types", "convert_argument", "normalize_structured_arguments"]

_STRING = ("string", "str", "text", "varchar", "char", "enum")
_INTEGER = ("int", "uint", "long", "short", "unsigned")
_NUMBER = ("num", "float")
_BOOLEAN = ("boolean", "bool", "binary")
_STRUCTURED_NAMES = ("object", "array", "arr")
_STRUCTURED_PREFIXES = ("dict", "list")
_STRUCTURED_DECLARED = {"array", "arr", "object", "dict", "list"}


def argument_schemas(function_name: str, tools: Any) -> dict[str, Any]:
    """Argument name to schema for ``function_name`` in an OpenAI ``tools`` list (``{}`` if undeclared)."""
    for tool in tools if isinstance(tools, list) else ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function" or function.get("name") != function_name:
            continue
        parameters = function.get("parameters")
        if not isinstance(parameters, dict):
            return {}
        properties = parameters.get("properties")
        return properties if isinstance(properties, dict) else parameters
    return {}


def declared_types(schema: Any) -> set[str]:
    """Lower-cased type names a JSON schema allows, through ``type`` lists and ``anyOf``/``oneOf``/``allOf``."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    names = [kind] if isinstance(kind, str) else [k for k in kind if isinstance(k, str)] if isinstance(kind, list) \
        else []
    found = {name.strip().lower() for name in names}
    for combinator in ("anyOf", "oneOf", "allOf"):
        options = schema.get(combinator)
        for option in options if isinstance(options, list) else ():
            found |= declared_types(option)
    return found


def _json_safe(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def _json(text: str) -> tuple[bool, Any]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return False, None
    return _json_safe(value), value


def _literal(text: str) -> tuple[bool, Any]:
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None
    return _json_safe(value), value


def _schema_type(schema: Any) -> str:
    """The one type name an argument is converted to: ``type`` as text, ``anyOf`` reads as object, else string."""
    if isinstance(schema, dict) and "type" in schema:
        return str(schema["type"]).strip().lower()
    if isinstance(schema, dict) and "anyOf" in schema:
        return "object"
    return "string"


def convert_argument(text: str, schema: Any, declared: bool = True) -> Any:
    """The JSON value of argument ``text`` given its ``schema`` (``declared``: the tool lists the argument).

    ``null`` is ``None`` for any type; an undeclared argument or a string type keeps the text;
    integers and numbers (integral numbers as integers) that do not parse, or are not finite,
    stay text; a boolean is ``text == "true"`` (case-insensitive); objects and arrays are read as
    JSON, then as a Python literal; other type names try the literal; else the text stays.
    """
    if text.lower() == "null":
        return None
    if not declared:
        return text
    kind = _schema_type(schema)
    if kind in _STRING:
        return text
    if kind.startswith(_INTEGER):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(_NUMBER):
        try:
            number = float(text)
        except ValueError:
            return text
        if not math.isfinite(number):
            return text
        return int(number) if number.is_integer() else number
    if kind in _BOOLEAN:
        return text.lower() == "true"
    if kind in _STRUCTURED_NAMES or kind.startswith(_STRUCTURED_PREFIXES):
        ok, value = _json(text)
        if ok:
            return value
    ok, value = _literal(text)
    return value if ok else text


def normalize_structured_arguments(arguments: dict[str, Any], schemas: dict[str, Any]) -> dict[str, Any]:
    """``arguments`` with JSON text (``[...]``/``{...}``) parsed where the schema allows an array or object."""
    out = dict(arguments)
    for key, value in arguments.items():
        if not isinstance(value, str) or not declared_types(schemas.get(key)) & _STRUCTURED_DECLARED:
            continue
        stripped = value.strip()
        if stripped[:1] in ("[", "{"):
            ok, parsed = _json(stripped)
            if ok and isinstance(parsed, (dict, list)):
                out[key] = parsed
    return out
