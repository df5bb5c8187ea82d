"""What a chat request asks of its output: tool calls and structured output.

ChatOutput is made per request by the chat route. In the route's thread pool it checks
`tools` / `tool_choice` / `response_format` against the model (its template must have a
tool-call format this server knows), renders the prompt with the tools through the
model's own template, and builds the grammar constraint that decoding obeys:

- response_format json_object / json_schema: the JSON (schema) grammar;
- tool_choice "required": one call or more (one with parallel_tool_calls false) of any
  tool, each tool's arguments by its `parameters` schema (objects closed where the schema
  is silent: `closed_objects`); a named function: one call of it;
- tool_choice "auto" (the default with tools): no grammar, the output is parsed; with a
  tool marked `strict`, a lazy grammar: the text is free until a call's marker, and the calls
  after it follow their tools' schemas (strict ones closed, the others any object);
- tool_choice "none": the tools are neither rendered nor parsed;
- llama-server's `grammar` (GBNF) and `json_schema` fields, as its chat route takes them.

Its `format` gives the route a ChatFormat that splits the text into reasoning, content and
tool_calls (OpenAI's message and chunk shapes, finish_reason "tool_calls"): a `<think>`
model's through reasoning.py, a harmony model's (gpt-oss) through harmony.py, with or
without tools. `shown_tokens` are the control tokens those splitters read, rendered as text.
"""
from __future__ import annotations

from ..engine import Engine
from ..grammar import (
    GrammarError,
    TokenConstraint,
    gbnf_grammar,
    json_schema_grammar,
    lark_grammar,
)
from ..tokenizer import Tokenizer, TokenType
from .errors import APIError
from .harmony import MARKERS as HARMONY_MARKERS
from .harmony import HarmonyStream, is_harmony
from .reasoning import ReasoningStream, Thinking, ThinkTags, reasoning_tags
from .responses import ChatFormat
from .schemas import ChatRequest
from .tool_formats import ToolCall, ToolFormat, ToolSpec, format_for_template
from .tool_stream import ToolStream

_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
_ANY_ARGUMENTS = {"type": "object"}


def closed_objects(schema):
    """A tool's parameters as its arguments: an object schema with `properties` and no word
    on others takes no others (a small model forced into an open object invents keys
    forever). Schemas that say additionalProperties keep it."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _bad(message: str, param: str) -> APIError:
    return APIError("invalid_request", message, param=param)


def native_grammar(gbnf: str | None, schema: dict | None) -> str | None:
    """llama-server's own fields: `grammar` (GBNF) or `json_schema`; None when neither is sent."""
    try:
        if gbnf:
            return gbnf_grammar(gbnf)
        if schema is not None:
            return json_schema_grammar(schema)
    except GrammarError as e:
        raise _bad(str(e), "grammar" if gbnf else "json_schema") from None
    return None


def response_grammar(rf) -> str | None:
    """OpenAI's response_format (json_object, json_schema) as a grammar; None for text or none."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        schema = rf.schema_ if rf.schema_ is not None else {"type": "object"}
    else:
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise _bad("response_format json_schema needs json_schema.schema", "response_format")
        schema = rf.json_schema.schema_
    try:
        return json_schema_grammar(schema)
    except GrammarError as e:
        raise _bad(str(e), "response_format") from None


def request_grammar(body) -> tuple[str | None, str]:
    """(the grammar a completion request asks for, the parameter that asked): response_format,
    else llama-server's grammar / json_schema fields (both completion routes take all three)."""
    grammar = response_grammar(body.response_format)
    if grammar is not None:
        return grammar, "response_format"
    return native_grammar(body.grammar, body.json_schema), "grammar" if body.grammar else "json_schema"


def make_constraint(engine: Engine, grammar: str | None, param: str) -> TokenConstraint | None:
    if grammar is None:
        return None
    try:
        return TokenConstraint(engine.grammar_vocab, grammar)
    except GrammarError as e:
        raise _bad(str(e), param) from None


class ChatOutput:
    def __init__(self, body: ChatRequest, reasoning_format: str = "auto"):
        self.body = body
        self.reasoning_format = reasoning_format     # the server's --reasoning-format
        self.think: tuple[ThinkTags, bool] | None = None   # (tags, the prompt left <think> open)
        self.harmony: tuple[str, bool] | None = None       # (the prompt's tail, split reasoning)
        self.tool_format: ToolFormat | None = None
        self.names: frozenset[str] = frozenset()
        self.constraint: TokenConstraint | None = None
        self.shown_tokens: frozenset[int] = frozenset()

    # -- in the thread pool, before the job is queued ---------------------------------
    def prompt_ids(self, engine: Engine) -> list[int]:
        body = self.body
        tools = body.tools or []
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
        if choice != "none" and not tools:
            raise _bad(f"tool_choice {self._choice_text(choice)} needs tools", "tool_choice")
        render = tools if choice != "none" else []
        if render:
            self._plan_tools(engine, choice)
        grammar, param = request_grammar(body)
        if grammar is not None and choice not in ("none", "auto"):
            raise _bad(f"{param} cannot be combined with a forced tool_choice", param)
        if grammar is None and render and (choice != "auto" or any(t.function.strict for t in tools)):
            grammar, param = self._tools_grammar(engine, choice), "tools"
        self.constraint = make_constraint(engine, grammar, param)
        kw = {"tools": [t.model_dump(exclude_none=True) for t in render]} if render else {}
        ids = engine.encode_chat(body.conversation(), **kw, **self._template_kwargs())
        template, reasoning = engine.chat_template.source, body.reasoning_format or self.reasoning_format
        tags = reasoning_tags(template, reasoning)
        if is_harmony(template):   # the prompt's tail opens the first message (<|start|>assistant)
            self.harmony = (engine.tokenizer.decode(ids[-8:]), reasoning != "none")
            self.shown_tokens |= self._shown(engine, HARMONY_MARKERS)
        elif tags is not None:     # the answer starts in reasoning where the prompt left <think> open
            self.think = (tags, tags.open_at_end(engine.tokenizer.decode(ids[-8:])))
        return ids

    @staticmethod
    def _shown(engine: Engine, markers: tuple[str, ...]) -> frozenset[int]:
        """The markers' control tokens that do not end generation: rendered as text."""
        tok = engine.tokenizer
        ids = (tok.id_of(m) for m in markers)
        return frozenset(t for t in ids if t is not None and tok.token_type(t) == TokenType.CONTROL
                         and t not in tok.stop_ids)

    def _template_kwargs(self) -> dict:
        """llama-server's chat_template_kwargs (enable_thinking, ...): the template's own
        variables, never the ones the server sets."""
        kw = self.body.chat_template_kwargs or {}
        taken = sorted(set(kw) & {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
        if taken:
            raise _bad(f"chat_template_kwargs may not set {', '.join(taken)}", "chat_template_kwargs")
        return kw

    @staticmethod
    def _choice_text(choice) -> str:
        return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"

    def _plan_tools(self, engine: Engine, choice) -> None:
        from ..chat import ChatTemplate
        if engine.chat_template is None:
            engine.chat_template = ChatTemplate.from_gguf_metadata(engine.gguf.metadata)
        fmt = format_for_template(engine.chat_template.source)
        if fmt is None:
            raise _bad("this model's chat template writes no tool-call format this server knows "
                       "(Hermes <tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS], gpt-oss harmony): "
                       "it cannot take tools", "tools")
        names = [t.function.name for t in self.body.tools]
        if len(set(names)) != len(names):
            raise _bad("two tools have the same name", "tools")
        if not isinstance(choice, str) and choice.function.name not in names:
            raise _bad(f"tool_choice names {choice.function.name!r}, which is not among the tools", "tool_choice")
        self.tool_format, self.names = fmt, frozenset(names)
        self.shown_tokens = self._shown(engine, fmt.markers)

    def _tools_grammar(self, engine: Engine, choice) -> str:
        tools = self.body.tools
        if not isinstance(choice, str):
            tools = [t for t in tools if t.function.name == choice.function.name]
        if choice == "auto":     # strict tools by their schema, the others' arguments any object
            specs = [ToolSpec(t.function.name, closed_objects(t.function.parameters or _NO_ARGUMENTS)
                              if t.function.strict else _ANY_ARGUMENTS) for t in tools]
            return lark_grammar(self.tool_format.lazy_grammar(specs, self.body.parallel_tool_calls,
                                                              engine.grammar_vocab))
        specs = [ToolSpec(t.function.name, closed_objects(t.function.parameters or _NO_ARGUMENTS)) for t in tools]
        parallel = choice == "required" and self.body.parallel_tool_calls
        return lark_grammar(self.tool_format.grammar(specs, parallel, engine.grammar_vocab))

    # -- the response ------------------------------------------------------------------
    def format(self, model: str, tokenizer: Tokenizer, want_logprobs: bool) -> ChatFormat:
        thinking: Thinking | None = None
        if self.harmony is not None:
            thinking = HarmonyStream(*self.harmony)
        elif self.think is not None:
            thinking = ReasoningStream(*self.think)
        if self.tool_format is None:
            return ChatFormat(model, tokenizer, want_logprobs, thinking)
        return ToolChatFormat(model, tokenizer, want_logprobs, ToolStream(self.tool_format, self.names), thinking)


def _call_json(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class ToolChatFormat(ChatFormat):
    """ChatFormat whose content goes through a ToolStream: calls come out as tool_calls
    (whole, in the delta of the chunk that completes them), finish_reason "tool_calls"."""

    def __init__(self, model: str, tokenizer: Tokenizer, want_logprobs: bool, stream: ToolStream,
                 thinking: Thinking | None = None):
        super().__init__(model, tokenizer, want_logprobs, thinking)
        self.stream = stream

    def _finish(self, finish_reason: str) -> str:
        return "tool_calls" if self.stream.calls and finish_reason == "stop" else finish_reason

    def _content_chunk(self, reasoning, content, logprobs, finish_reason):
        first = len(self.stream.calls)
        content, calls = self.stream.feed(content or "")
        if finish_reason is not None:
            tail, more = self.stream.finish()
            content, calls = content + tail, calls + more
        out = super()._content_chunk(reasoning, content or None, logprobs,
                                     None if finish_reason is None else self._finish(finish_reason))
        if calls:
            out["choices"][0]["delta"]["tool_calls"] = [{"index": first + i, **_call_json(c)}
                                                        for i, c in enumerate(calls)]
        return out

    def _response(self, reasoning, content, logprobs, finish_reason, usage, timings):
        head, _ = self.stream.feed(content or "")
        tail, _ = self.stream.finish()
        out = super()._response(reasoning, (head + tail).strip(), logprobs, self._finish(finish_reason), usage, timings)
        message = out["choices"][0]["message"]
        if self.stream.calls:
            message["tool_calls"] = [_call_json(c) for c in self.stream.calls]
            message["content"] = message["content"] or None
        return out
