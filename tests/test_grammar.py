"""Grammar-constrained decoding (grammar.py) with the embedded model: a constrained greedy
run never leaves the schema (its output parses and validates, checked by jsonschema, not
by the grammar library), speculation inside a grammar is exact, and the masks say what
the grammar says."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from alphallama.engine import Engine, Generation
from alphallama.grammar import (
    GrammarError,
    TokenConstraint,
    json_schema_grammar,
    lark_grammar,
)
from alphallama.spec.config import SpecConfig

EMBEDDED = Path(__file__).resolve().parents[1] / "src" / "alphallama" / "data" / "alphallama-embedded.gguf"
pytestmark = pytest.mark.usefixtures("one_thread")

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
                         "role": {"enum": ["admin", "user", "guest"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
          "required": ["name", "age", "role", "tags"], "additionalProperties": False}
# integers with bounds: a float's digits are unbounded in the grammar (llguidance has no digit cap, llama.cpp's
# converter caps 16), and a small greedy model may write 0.0000... until max_tokens (the 2026-12-07 model does)
NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": -1000, "maximum": 1000}, "minItems": 2, "maxItems": 5}
PROMPTS = ["Describe the user who wrote this file as JSON.", "Write a Python function that returns a list.",
           "Change every double-quoted string in this file to single quotes."]
SPECS = {"ngram": SpecConfig("ngram", draft_max=16, ngram_min=2, gate=False),
         "mtp": SpecConfig("mtp", gate=False, mtp_switch=False)}


@pytest.fixture(scope="module")
def engine():
    return Engine.load(str(EMBEDDED))


def _run(engine, prompt: str, grammar: str, spec: SpecConfig = SpecConfig("none"), max_tokens: int = 160,
         **kw) -> tuple[str, Generation]:
    ids = engine.encode_chat([{"role": "user", "content": prompt}])
    gen = Generation()
    toks = list(engine.generate(ids, max_tokens, gen=gen, spec=spec,
                                constraint=TokenConstraint(engine.grammar_vocab, grammar), **kw))
    return engine.tokenizer.decode(toks, continuation=True), gen


@pytest.mark.parametrize("schema", [PERSON, NUMBERS], ids=["object", "array"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_constrained_greedy_output_validates(engine, schema, prompt):
    text, gen = _run(engine, prompt, json_schema_grammar(schema))
    assert gen.finish_reason == "stop", (gen.finish_reason, text)   # ended by the model, the grammar complete
    jsonschema.validate(json.loads(text), schema)


def test_json_object_is_an_object(engine):
    text, gen = _run(engine, PROMPTS[1], json_schema_grammar({"type": "object"}), max_tokens=200)
    if gen.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:   # cut by max_tokens: still a prefix of an object
        assert text.lstrip().startswith("{")


@pytest.mark.parametrize("spec", list(SPECS), ids=list(SPECS))
def test_speculation_inside_a_grammar_is_exact(engine, spec):
    grammar = json_schema_grammar(PERSON)
    plain, _ = _run(engine, PROMPTS[0], grammar)
    drafted, gen = _run(engine, PROMPTS[0], grammar, SPECS[spec])
    assert drafted == plain
    assert gen.stats.draft_n > 0   # drafts were proposed and checked against the grammar


def test_sampled_runs_stay_inside_the_grammar(engine):
    from alphallama.sampling import SamplingParams
    for seed in range(3):
        text, gen = _run(engine, PROMPTS[seed], json_schema_grammar(PERSON), SPECS["ngram"],
                         sampling=SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed))
        if gen.finish_reason == "stop":
            jsonschema.validate(json.loads(text), PERSON)


def test_masks_follow_the_grammar(engine):
    tok = engine.tokenizer
    c = TokenConstraint(engine.grammar_vocab, json_schema_grammar(PERSON))
    doc = tok.encode('{"name": "Ada", "age": 36, "role": "admin", "tags": []}')
    assert c.valid_prefix(doc) == len(doc)
    assert c.valid_prefix(tok.encode('{"nome"')) < len(tok.encode('{"nome"'))
    logits = torch.zeros(len(doc) + 1, engine.cfg.vocab_size)
    allowed = c.mask_rows(logits, doc) > float("-inf")            # [W, V]
    assert all(allowed[i, t] for i, t in enumerate(doc))
    stops = sorted(tok.stop_ids)
    assert not allowed[:-1, stops].any() and allowed[-1, stops].all()   # EOG exactly when complete
    assert int(allowed[-1].sum()) == len(stops)
    assert c.valid_prefix(doc) == len(doc)                          # mask_rows left the state as it was


def test_a_draft_ending_in_a_stop_token_leaves_the_state(engine):
    """A copy draft may run through the end-of-generation token (the document complete):
    the masks are the rows' and the matcher is where it was, so the next round's commits
    hold. (llguidance's rollback over a consumed stop token is not exact: a server's tool
    call once failed its grammar two rounds later.)"""
    tok = engine.tokenizer
    c = TokenConstraint(engine.grammar_vocab, json_schema_grammar(PERSON))
    doc = tok.encode('{"name": "Ada", "age": 36, "role": "admin", "tags": []}')
    head, tail = doc[:5], doc[5:]
    for t in head:
        c.commit(t)
    before = c.mask_rows(torch.zeros(1, engine.cfg.vocab_size), [])
    stop = sorted(tok.stop_ids)[0]
    drafts = tail + [stop]
    allowed = c.mask_rows(torch.zeros(len(drafts) + 1, engine.cfg.vocab_size), drafts) > float("-inf")
    assert all(allowed[i, t] for i, t in enumerate(drafts))         # the stop token too, at its row
    assert torch.equal(c.mask_rows(torch.zeros(1, engine.cfg.vocab_size), []), before)
    for t in tail:                                                  # the round's commits
        c.commit(t)
    assert c.finished or c.valid_prefix([stop]) == 1


def test_special_tokens_by_id(engine):
    start = engine.tokenizer.id_of("<|im_start|>")   # a control token that does not end generation
    c = TokenConstraint(engine.grammar_vocab, lark_grammar(f'start: "ok" <[{start}]> "x"'))
    ok = engine.tokenizer.encode("ok")
    assert c.valid_prefix(ok + [start]) == len(ok) + 1
    assert c.valid_prefix(ok + engine.tokenizer.encode("<|im_start|>")) == len(ok)   # the text is not the token


@pytest.mark.parametrize("schema", [{"type": "nonsense"}, {"$ref": "#/nowhere"}, {"minimum": "a"}])
def test_bad_schemas_are_grammar_errors(engine, schema):
    with pytest.raises(GrammarError):
        TokenConstraint(engine.grammar_vocab, json_schema_grammar(schema))


SPM_VOCAB = Path(__file__).resolve().parent / "data" / "vocab" / "ggml-vocab-llama-spm.gguf"


@pytest.mark.parametrize("schema", [{}, PERSON, NUMBERS], ids=["any", "object", "array"])
def test_spm_vocabulary_forced_bytes_spell_themselves(schema):
    """A SentencePiece vocabulary (llama 2, Gemma, Mistral) prefixes a space to what it
    encodes: the grammar library, tokenizing the bytes a grammar forces ("rue" after "t"),
    was handed " r" and then refused the token it had allowed (a 500 on `json_schema: {}`
    with stories260K, found by fuzzing the server). Walks under random logits: every
    emitted token is one the mask allowed and the matcher takes, and a finished walk is
    JSON that the schema (jsonschema, not the grammar library) accepts."""
    from alphallama.grammar import GrammarVocab
    from alphallama.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(SPM_VOCAB)
    vocab = GrammarVocab(tok)
    assert tok.encode_running("rue") and b"".join(tok.token_to_piece(i) for i in tok.encode_running("rue")) == b"rue"
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        c = TokenConstraint(vocab, json_schema_grammar(schema))
        text = b""
        for _ in range(80):
            logits = c.mask_rows(torch.randn(1, vocab.n_vocab, generator=g), [])[0]
            t = int(logits.argmax())
            assert logits[t] > float("-inf")
            if t in tok.stop_ids:
                break
            c.commit(t)                                  # raised on the token the mask had allowed
            text += tok.token_to_piece(t)
        if c.finished or t in tok.stop_ids:
            jsonschema.validate(json.loads(text), schema)
    after_t = TokenConstraint(vocab, json_schema_grammar({}))
    after_t.commit(tok.encode_running("t")[0])
    allowed = (after_t.mask_rows(torch.zeros(1, vocab.n_vocab), [])[0] > float("-inf")).nonzero().flatten()
    assert len(allowed) and all(b"rue".startswith(tok.token_to_piece(int(i))) for i in allowed)
