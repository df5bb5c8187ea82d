"""Chat templates: a model's Jinja template rendered the way HF transformers does.

Templates come from the model file (`tokenizer.chat_template`) and are untrusted code,
so they run in chat_sandbox's budgeted sandbox: Jinja's immutable sandbox (no access to
Python internals, no mutation of the messages passed in) with a deadline and a size cap,
so a hostile template is stopped with TemplateBudgetError instead of hanging or eating
the machine. The environment copies `apply_chat_template`'s: trim_blocks
and lstrip_blocks on, loop controls ({% break %}, {% continue %}), a `tojson` filter that
keeps non-ASCII text as is, the `raise_exception` and `strftime_now` globals, and the
`{% generation %}` tag (rendered as its body). Every failure while compiling or rendering
a template surfaces as ChatTemplateError (a ValueError and a jinja2.TemplateError) with
the template's own message.

A model without a template gets ChatML, as llama.cpp's server does (pass fallback=None
to from_gguf_metadata to get None instead).
"""
from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension

from alphallama.gguf.reader import GGUFError

from .chat_sandbox import DEFAULT_BUDGET, ChatTemplateError, RenderBudget, SizedSandbox, TemplateBudgetError
from .chat_sandbox import render_budgeted

__all__ = ["CHATML_TEMPLATE", "CHAT_TEMPLATE_KEY", "ChatTemplate", "ChatTemplateError", "RenderBudget",
           "TemplateBudgetError", "chat_prompt_ids", "chat_prompt_text"]

if TYPE_CHECKING:  # rendering needs no tokenizer; only chat_prompt_ids takes one
    from alphallama.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"

# The default for models that ship no template (llama.cpp's choice too).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class _TemplateRaised(Exception):
    """raise_exception() called by the template: its message goes to the user verbatim."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's filter, not Jinja's: no HTML escaping, non-ASCII kept, json.dumps' arguments.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for HF's training
    masks; for inference it is just its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class ChatTemplate:
    """A compiled chat template.

    `clock` feeds `strftime_now` (templates that print today's date); tests pin it.
    `budget` bounds each render's time and size (tests make it small)."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", *,
                 clock: Callable[[], datetime] = datetime.now, budget: RenderBudget = DEFAULT_BUDGET):
        if not isinstance(source, str):
            raise ChatTemplateError(f"a chat template must be a string, not {type(source).__name__}")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.budget = budget
        env = SizedSandbox(
            budget, filters={"tojson": _tojson}, trim_blocks=True, lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _GenerationTag])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: clock().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from e

    @classmethod
    def from_gguf_metadata(cls, md: Mapping[str, Any], fallback: str | None = CHATML_TEMPLATE,
                           name: str | None = None) -> "ChatTemplate | None":
        """The model's template (`tokenizer.chat_template`, or `.<name>` for a named one)
        with its BOS/EOS token texts. Without one: `fallback` (ChatML), or None when
        fallback is None."""
        key = CHAT_TEMPLATE_KEY + (f".{name}" if name else "")
        source = md.get(key)
        if source is None:
            if fallback is None:
                return None
            log.warning("the model has no %s; using the ChatML template", key)
            source = fallback
        elif not isinstance(source, str):
            raise GGUFError(f"metadata {key} must be a string, not {type(source).__name__}")
        tokens = md.get("tokenizer.ggml.tokens") or []
        return cls(source, bos_token=_token_text(md, tokens, "tokenizer.ggml.bos_token_id"),
                   eos_token=_token_text(md, tokens, "tokenizer.ggml.eos_token_id"))

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text for `messages` (dicts with "role", "content", ...).

        Extra keyword arguments become template variables (enable_thinking, date_string,
        documents, ...), as in HF's apply_chat_template."""
        context = {"messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
                   "bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}
        try:
            return render_budgeted(self._template, context)
        except ChatTemplateError:   # the budget's refusals, as they are
            raise
        except _TemplateRaised as e:
            raise ChatTemplateError(str(e)) from None
        except jinja2.TemplateError as e:   # includes the sandbox's SecurityError
            raise ChatTemplateError(f"chat template failed: {e}") from e
        except Exception as e:  # the template is foreign code: any failure is its failure
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


def _token_text(md: Mapping[str, Any], tokens: Sequence[str], key: str) -> str:
    tid = md.get(key)
    if isinstance(tid, int) and 0 <= tid < len(tokens):
        return tokens[tid]
    return ""


def chat_prompt_ids(template: ChatTemplate, tokenizer: "Tokenizer", messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True, tools: Iterable[Mapping[str, Any]] | None = None,
                    **kwargs: Any) -> list[int]:
    """Render and tokenize a conversation as llama.cpp's server does.

    The template usually writes the BOS text itself; when the tokenizer adds BOS (and
    EOS) on its own, that text is cut from the rendered prompt so the token is not
    doubled. Special-token text in the prompt becomes the special tokens."""
    text = chat_prompt_text(template, tokenizer, messages, add_generation_prompt, tools, **kwargs)
    return tokenizer.encode(text, add_special=True, parse_special=True)


def chat_prompt_text(template: ChatTemplate, tokenizer: "Tokenizer", messages: Sequence[Mapping[str, Any]],
                     add_generation_prompt: bool = True, tools: Iterable[Mapping[str, Any]] | None = None,
                     **kwargs: Any) -> str:
    """The text chat_prompt_ids tokenizes (for callers that check its length first)."""
    text = template.render(messages, add_generation_prompt=add_generation_prompt,
                           tools=list(tools) if tools is not None else None, **kwargs)
    if tokenizer.add_bos and template.bos_token and text.startswith(template.bos_token):
        text = text[len(template.bos_token):]
    if tokenizer.add_eos and template.eos_token and text.endswith(template.eos_token):
        text = text[:-len(template.eos_token)]
    return text
