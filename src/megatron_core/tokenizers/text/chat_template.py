"""Render a Jinja chat template (the one place that imports ``jinja2``, lazily)."""

from __future__ import annotations

from typing import Any


def render_chat_template(template: str, conversation: list[dict[str, str]], **variables: Any) -> str:
    """Render ``template`` with ``messages=conversation`` and ``variables`` in a sandboxed environment.

    Follows the Hugging Face convention: ``trim_blocks``/``lstrip_blocks`` and a
    ``raise_exception`` helper available to templates.
    """
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as error:
        raise ImportError("chat templates need the 'jinja2' package: pip install jinja2") from error

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(template).render(messages=conversation, **variables)
