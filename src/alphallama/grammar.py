"""Grammar-constrained decoding: the tokens a grammar forbids get -inf before one is chosen.

The grammar library is llguidance (docs/decisions/grammar-library.md). GrammarVocab wraps
a Tokenizer for it once per engine; a TokenConstraint is one request's matcher. The engine
asks three things of it each round: how many of the drafts the grammar accepts (the rest
are cut), the masked logits of the round's rows (row i under the state after drafts
[:i]), and to commit each token it emits. End-of-generation tokens are the grammar's EOS
set: they are allowed exactly when the text so far is complete.

Grammars are llguidance's JSON grammar strings, made by `json_schema_grammar`,
`lark_grammar` or `gbnf_grammar`; a schema or grammar the library refuses raises GrammarError (a ValueError,
a 400 in the server).
"""
from __future__ import annotations

import copy
import json

import torch

from .tokenizer import Tokenizer
from .tokenizer.vocab import TokenType

# Between two JSON tokens: nothing, one space, or a newline and up to 20 spaces or tabs of
# indentation (llama.cpp's JSON grammars bound it the same way): a small model otherwise
# fills its budget with whitespace once it has started some.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})"
_JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}


class GrammarError(ValueError):
    """A grammar or JSON schema the library cannot compile; the message says why."""


def _llguidance():
    import llguidance
    return llguidance


def _with_options(schema: dict) -> dict:
    out = copy.deepcopy(schema)
    out["x-guidance"] = {**_JSON_OPTIONS, **(out.get("x-guidance") or {})}
    return out


def json_schema_grammar(schema: dict | bool) -> str:
    """A grammar for JSON text valid under `schema` (True / {}: any JSON value)."""
    if schema is True or schema == {}:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, not {type(schema).__name__}")
    try:
        return _llguidance().LLMatcher.grammar_from_json_schema(json.dumps(_with_options(schema)))
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None


def lark_json(schema: dict) -> str:
    """`schema` as a Lark rule body (`%json {...}`), with the same whitespace bound."""
    return "%json " + json.dumps(_with_options(schema))


def lark_grammar(lark: str) -> str:
    return _llguidance().LLMatcher.grammar_from_lark(lark)


def gbnf_grammar(gbnf: str) -> str:
    """llama.cpp's GBNF (`root ::= ...`), as llama-server's `grammar` field takes it."""
    from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark
    try:
        return lark_grammar(gbnf_to_lark(gbnf))
    except GbnfToLarkError as e:
        raise GrammarError(f"invalid GBNF grammar: {e}") from None


class GrammarVocab:
    """A Tokenizer as llguidance sees it: every token's bytes, control tokens marked special
    (a grammar names them as <[id]>; text never spells them), the end-of-generation tokens
    as the EOS set. Building it walks the vocabulary (~0.6 s for 152k tokens): once per engine."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int | None = None):
        llg = _llguidance()
        n = tokenizer.vocab_size
        special = [i for i in range(n) if tokenizer.token_type(i) == TokenType.CONTROL]
        pieces = [tokenizer.token_to_piece(i, special=True) for i in range(n)]
        for i in special:
            pieces[i] = b"\xff" + pieces[i]     # llguidance's mark of a special token
        stops = sorted(tokenizer.stop_ids)
        if not stops:
            raise GrammarError("the model's vocabulary has no end-of-generation token")

        class _Wrapped:                          # the duck type llguidance.TokenizerWrapper reads
            eos_token_id, bos_token_id = stops[0], tokenizer.bos_id
            tokens, special_token_ids = pieces, special

            def __call__(self, text):    # the bytes the grammar forces, as tokens that spell them
                if isinstance(text, bytes):
                    text = text.decode("utf-8", errors="replace")
                return tokenizer.encode_running(text)
        self.tokenizer = tokenizer
        self.n_vocab = max(n_vocab or n, n)                # logits may have padding columns
        self.lltok = llg.LLTokenizer(llg.TokenizerWrapper(_Wrapped()), n_vocab=self.n_vocab, eos_token=stops)
        self._bits = torch.tensor([1 << b for b in range(32)], dtype=torch.int64).to(torch.int32)   # [32]

    def special_token(self, text: str) -> int | None:
        """The id of a control token spelled `text`, else None (then text spells it)."""
        tid = self.tokenizer.id_of(text)
        if tid is not None and self.tokenizer.token_type(tid) == TokenType.CONTROL:
            return tid
        return None

    def allowed(self, bitmask: torch.Tensor) -> torch.Tensor:
        """bitmask [W, ceil(V / 32)] int32 -> allowed [W, V] bool, on the bitmask's device."""
        bits = (bitmask[:, :, None] & self._bits.to(bitmask.device)) != 0   # [W, V/32, 32]
        return bits.reshape(bitmask.shape[0], -1)[:, :self.n_vocab]


class TokenConstraint:
    """One request's grammar state. Tokens are committed with `commit`; everything else
    leaves the state as it found it."""

    def __init__(self, vocab: GrammarVocab, grammar: str):
        llg = _llguidance()
        self.vocab = vocab
        self.grammar = grammar
        self._m = llg.LLMatcher(vocab.lltok, grammar, log_level=0)
        if self._m.is_error():
            raise GrammarError(f"the grammar does not compile: {self._m.get_error()}")
        self._words = (vocab.n_vocab + 31) // 32

    def _fail(self) -> None:
        raise RuntimeError(f"grammar matcher failed: {self._m.get_error()}")

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (after what is committed) the grammar accepts."""
        return self._m.validate_tokens(tokens) if tokens else 0

    def commit(self, token: int) -> None:
        if not self._m.consume_token(token):
            self._fail()

    @property
    def finished(self) -> bool:
        """The grammar takes no further token but an end-of-generation one."""
        return self._m.is_stopped()

    def mask_rows(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """logits [1 + len(drafts), V] -> the same with forbidden tokens at -inf: row i under
        the state after drafts[:i] (the drafts must be valid_prefix-checked)."""
        w = logits.shape[0]
        assert w == len(drafts) + 1, (w, len(drafts))
        bitmask = torch.full((w, self._words), -1, dtype=torch.int32)   # rows past a stop: never emitted
        stops = self.vocab.tokenizer.stop_ids
        consumed = 0
        for i in range(w):
            self._m.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), self._words * 4)
            if self._m.is_error():
                self._fail()
            if i == len(drafts) or drafts[i] in stops:   # generation ends at a stop token: the matcher
                break                                    # is not taken past it (its rollback is not exact)
            if not self._m.consume_token(drafts[i]):
                self._fail()
            consumed += 1
        if consumed:
            self._m.rollback(consumed)
        # unpacked where the logits are: 32x fewer bytes cross to a GPU
        allowed = self.vocab.allowed(bitmask.to(logits.device, non_blocking=True))   # [W, V'] bool
        v = logits.shape[-1]
        if allowed.shape[1] < v:                                # columns beyond the vocabulary
            allowed = torch.nn.functional.pad(allowed, (0, v - allowed.shape[1]))
        return logits.masked_fill(~allowed[:, :v], float("-inf"))

