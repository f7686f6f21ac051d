"""Chat templates: a conversation -> the prompt text a chat model was trained on.

Rendered the way transformers renders them (`transformers.utils.chat_template_utils`), so
that a model's template gives the same text here: Jinja2's immutable sandbox (a template from
the Hub is untrusted code) with `trim_blocks` and `lstrip_blocks`, the loop-control extension,
a `tojson` filter that does not escape HTML, the globals `raise_exception(message)` and
`strftime_now(format)`, and the variables `messages` (None-valued keys dropped),
`add_generation_prompt`, `tools` and `documents` (None here) and the tokenizer's named special
tokens (`bos_token`, `eos_token`, `unk_token`, `pad_token`, ... where it has them).
`{% generation %}` blocks (transformers marks the assistant's text with them for training
masks) render their body.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moe_jax.tokenizer.data_error import DataError


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: the body, as rendered without tracking."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
) -> str:
    """The conversation as `template` renders it; DataError (one line) if the template fails
    to parse or refuses the conversation (e.g. roles that do not alternate)."""
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    try:
        return _compiled(template).render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
        )
    except jinja2.TemplateError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"the tokenizer's chat template failed: {first}") from None
