"""Chat templates: the checkpoint's own Jinja template, rendered as the hub's tooling renders it.

Instruct checkpoints (Llama 3, Qwen2, Mistral ...) ship the prompt format they were trained on as a
Jinja template (``chat_template`` in tokenizer_config.json, or chat_template.jinja). It is rendered in
a sandboxed environment with the same settings, globals and filters as transformers'
``apply_chat_template`` (``trim_blocks``, ``lstrip_blocks``, loop controls, ``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII text), with the special tokens by role
(``bos_token``, ``eos_token`` ...) in scope. A checkpoint without a template is an error: guessing a
format would silently give a model a prompt it was not trained on.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Optional

from gencli.errors import UserError


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Optional[int] = None, separators=None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise UserError(f"the checkpoint's chat template is not valid Jinja: {exc.message} (line {exc.lineno})") from None


def build_messages(prompt: str, system: Optional[str] = None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return messages


def render_chat(
    template: Optional[str], messages: list[dict[str, Any]], special_tokens: dict[str, str], *, add_generation_prompt: bool = True, where: str = ""
) -> str:
    """The prompt text for ``messages`` in the checkpoint's format (tokenize it without adding a BOS:
    the template writes the special tokens it wants)."""
    import jinja2

    if not template:
        raise UserError(
            f"the model{(' ' + repr(where)) if where else ''} has no chat template (no chat_template in tokenizer_config.json, "
            "no chat_template.jinja): --chat needs an instruct checkpoint that ships one; run without --chat for plain completion"
        )
    compiled = _compile(template)
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=None, documents=None, **special_tokens)
    except jinja2.exceptions.TemplateError as exc:
        raise UserError(f"the checkpoint's chat template refused the conversation: {exc}") from None
