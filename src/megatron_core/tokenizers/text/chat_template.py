"""Render a Jinja chat template (the one place that imports ``jinja2``, lazily)."""

from __future__ import annotations

import json
from typing import Any


def render_chat_template(template: str, conversation: list[dict[str, str]], **variables: Any) -> str:
    """Render ``template`` with ``messages=conversation`` and ``variables`` in a sandboxed environment.

    Follows the Hugging Face convention: ``trim_blocks``/``lstrip_blocks``, ``{% break %}`` and
    ``{% continue %}``, a ``raise_exception`` helper and a ``tojson`` filter that keeps non-ASCII
    text and HTML characters as they are (tool schemas in prompts).
    """
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as error:
        raise ImportError("chat templates need the 'jinja2' package: pip install jinja2") from error

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    environment.globals["raise_exception"] = raise_exception
    environment.filters["tojson"] = tojson
    return environment.from_string(template).render(messages=conversation, **variables)
