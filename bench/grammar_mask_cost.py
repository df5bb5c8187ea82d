"""Per-token mask cost of the grammar libraries on a real vocabulary (issue 33, step 2).

For llguidance, xgrammar and outlines-core: the time to prepare the vocabulary, to
compile a JSON schema (and generic JSON, where the library can), and the cost of one
mask per token while walking a valid document token by token (mask, then consume the
document's next token; the walk fails loudly if a library rejects a valid token).
The vocabulary is Qwen2's (151,936 tokens) from ../shared/data/vocab/ggml-vocab-qwen2.gguf
when present, else the embedded model's, read by our own Tokenizer.

Run in a scratch venv holding the three libraries (none is a project dependency here):
  python -m venv --system-site-packages /tmp/g && /tmp/g/bin/pip install llguidance xgrammar outlines-core
  PYTHONPATH=src /tmp/g/bin/python bench/grammar_mask_cost.py --out bench/results/grammar-mask-cost-DATE.json
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import statistics
import time
from pathlib import Path

from alphallama.tokenizer import Tokenizer
from alphallama.tokenizer.vocab import SPECIAL_TYPES

ROOT = Path(__file__).resolve().parents[1]
QWEN2 = ROOT.parent / "shared" / "data" / "vocab" / "ggml-vocab-qwen2.gguf"
EMBEDDED = ROOT / "src" / "alphallama" / "data" / "alphallama-embedded.gguf"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
DOC = {"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "engines", "poetry of science"],
       "address": {"city": "London", "zip": "W1 4AB"}}


class Vocab:
    """Our tokenizer's view every library adapter needs."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.n = tok.vocab_size
        self.pieces = [tok.token_to_piece(i, special=True) for i in range(self.n)]
        self.special = [i for i in range(self.n) if tok.token_type(i) in SPECIAL_TYPES]
        self.eos = tok.eos_id
        self.stops = sorted(tok.stop_ids)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)


# -- one adapter per library: prepare(vocab), compile(schema|None), a matcher with mask/consume

class LLGuidance:
    name = "llguidance"

    def prepare(self, v: Vocab):
        import llguidance
        special = set(v.special)

        class _Gt:   # llguidance.TokenizerWrapper's duck type
            eos_token_id, bos_token_id = v.eos, v.tok.bos_id
            tokens = [b"" if i in special else p for i, p in enumerate(v.pieces)]
            special_token_ids = sorted(special)

            def __call__(self, s):
                return v.encode(s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s)
        self.tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Gt()))
        self.n = v.n

    def compile(self, schema):
        import llguidance
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"})
        m = llguidance.LLMatcher(self.tok, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def walk(self, m, ids):
        import torch
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask
        mask = allocate_token_bitmask(1, self.n)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            fill_next_token_bitmask(m, mask)
            times.append(time.perf_counter() - t0)
            assert (int(mask[0, t // 32]) >> (t % 32)) & 1, f"token {t} masked out"
            assert m.consume_token(t), m.get_error()
        del torch
        return times


class XGrammar:
    name = "xgrammar"

    def prepare(self, v: Vocab):
        import xgrammar as xgr
        self.info = xgr.TokenizerInfo(v.pieces, xgr.VocabType.RAW, vocab_size=v.n, stop_token_ids=v.stops)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.n = v.n

    def compile(self, schema):
        import xgrammar as xgr
        g = (self.compiler.compile_json_schema(json.dumps(schema)) if schema is not None
             else self.compiler.compile_builtin_json_grammar())
        return xgr.GrammarMatcher(g)

    def walk(self, m, ids):
        import xgrammar as xgr
        mask = xgr.allocate_token_bitmask(1, self.n)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - t0)
            assert (int(mask[0, t // 32]) >> (t % 32)) & 1, f"token {t} masked out"
            assert m.accept_token(t)
        return times


class OutlinesCore:
    name = "outlines-core"

    def prepare(self, v: Vocab):
        from outlines_core import Vocabulary
        special = set(v.special)
        table: dict[bytes, list[int]] = {}
        for i, p in enumerate(v.pieces):
            if i not in special and p and i != v.eos:
                table.setdefault(p, []).append(i)
        self.vocab = Vocabulary(v.eos, table)
        self.n = v.n

    def compile(self, schema):
        from outlines_core import Guide, Index
        from outlines_core.json_schema import build_regex_from_schema
        if schema is None:
            raise NotImplementedError("outlines-core compiles regular expressions only: generic JSON "
                                      "(unbounded nesting) is not regular")
        return Guide(Index(build_regex_from_schema(json.dumps(schema)), self.vocab))

    def walk(self, g, ids):
        import torch
        mask = torch.zeros((self.n + 31) // 32, dtype=torch.int32)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            g.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
            times.append(time.perf_counter() - t0)
            assert (int(mask[t // 32]) >> (t % 32)) & 1, f"token {t} masked out"
            g.advance(t)
        return times


def _summary(times: list[float]) -> dict:
    us = sorted(1e6 * t for t in times)
    return {"tokens": len(us), "mean_us": statistics.fmean(us), "median_us": statistics.median(us),
            "p90_us": us[int(0.9 * (len(us) - 1))], "max_us": us[-1]}


def measure(lib, v: Vocab, repeats: int) -> dict:
    dist = importlib.metadata.distribution(lib.name)
    wheel = next(f for f in dist.files if str(f).endswith(".dist-info/WHEEL")).read_text()
    out: dict = {"version": dist.version, "wheel_tags": [ln[5:] for ln in wheel.splitlines() if ln.startswith("Tag: ")],
                 "requires": [r for r in (dist.requires or []) if "extra ==" not in r]}
    t0 = time.perf_counter()
    lib.prepare(v)
    out["prepare_vocab_s"] = time.perf_counter() - t0
    for label, schema, doc in (("json_schema", SCHEMA, DOC), ("json_object", None, DOC)):
        ids = v.encode(json.dumps(doc, separators=(",", ":")))
        try:
            t0 = time.perf_counter()
            m = lib.compile(schema)
            compile_s = time.perf_counter() - t0
            times = []
            for _ in range(repeats):    # a fresh matcher each pass: the walk consumes it
                times += lib.walk(m, ids)
                m = lib.compile(schema)
            out[label] = {"compile_s": compile_s, **_summary(times)}
        except NotImplementedError as e:
            out[label] = {"unsupported": str(e)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    path = QWEN2 if QWEN2.exists() else EMBEDDED
    v = Vocab(Tokenizer.from_gguf(path))
    result = {"vocab": path.name, "vocab_size": v.n, "schema": SCHEMA, "document": DOC,
              "machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine()},
              "libraries": {}}
    for lib in (LLGuidance(), XGrammar(), OutlinesCore()):
        print("measuring", lib.name, flush=True)
        result["libraries"][lib.name] = measure(lib, v, args.repeats)
        print(json.dumps(result["libraries"][lib.name], indent=1), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
