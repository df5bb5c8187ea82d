"""Which share of a model's output the MTP head could never draft, per language: a
fixed first-N draft vocabulary against the script-adaptive one (spec/draft_vocab.py).

For each language a chat request is written in that language (asking for an answer in
it); the model's greedy output is generated with the engine, and each output token is
checked against the N rows the head would score: the first N ids, or the subset chosen
from the prompt's scripts. A token outside the subset cannot be drafted, whatever the
head predicts. Runs on CPU or CUDA.

    python bench/draft_vocab_share.py MODEL.gguf [--langs en,ru,...] [--tokens 24] [--sizes 32768]
    python bench/draft_vocab_share.py MODEL.gguf --rescore OLD.json   # same outputs, current subsets
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from alphallama.bench.hostinfo import host_state
from alphallama.config import DEFAULTS
from alphallama.engine import Engine, Generation
from alphallama.spec.draft_vocab import DraftVocab, prompt_scripts
from alphallama.tokenizer import Tokenizer

PROMPTS = {
    "en": "Explain in a few sentences what a hash table is and why lookups in it are fast.",
    "ru": "Объясни в нескольких предложениях, что такое хеш-таблица и почему поиск в ней быстрый. "
          "Ответь по-русски.",
    "ar": "اشرح في بضع جمل ما هو جدول التجزئة ولماذا يكون البحث فيه سريعًا. أجب باللغة العربية.",
    "zh": "用几句话解释什么是哈希表，以及为什么在哈希表中查找很快。请用中文回答。",
    "ja": "ハッシュテーブルとは何か、そしてなぜ検索が速いのかを数文で説明してください。日本語で答えてください。",
    "ko": "해시 테이블이 무엇인지, 그리고 왜 검색이 빠른지 몇 문장으로 설명해 주세요. 한국어로 답해 주세요.",
    "hi": "कुछ वाक्यों में समझाइए कि हैश टेबल क्या है और उसमें खोज तेज़ क्यों होती है। हिंदी में उत्तर दीजिए।",
    "el": "Εξήγησε σε λίγες προτάσεις τι είναι ένας πίνακας κατακερματισμού και γιατί η αναζήτηση σε αυτόν "
          "είναι γρήγορη. Απάντησε στα ελληνικά.",
    "he": "הסבר בכמה משפטים מהי טבלת גיבוב ומדוע חיפוש בה מהיר. ענה בעברית.",
    "th": "อธิบายสั้น ๆ ว่าตารางแฮชคืออะไร และทำไมการค้นหาในตารางแฮชจึงรวดเร็ว กรุณาตอบเป็นภาษาไทย",
    "es": "Explica en pocas frases qué es una tabla hash y por qué las búsquedas en ella son rápidas. "
          "Responde en español.",
    "de": "Erkläre in wenigen Sätzen, was eine Hashtabelle ist und warum die Suche darin schnell ist. "
          "Antworte auf Deutsch.",
}
DEFAULT_LANGS = "en,ru,ar,zh,ja,ko,hi,el"


def default_sizes(V: int) -> list[int]:
    """The configured size; on a vocabulary no larger than it (where both subsets are the
    whole vocabulary), fractions of the vocabulary to show the effect at all."""
    S = DEFAULTS.mtp.draft_vocab
    return [S] if V > S else [V // 8, V // 4, V // 2]


def chat_ids(model: str, tok, text: str) -> list[int]:
    """The prompt the engine builds for one user message (as Engine.encode_chat)."""
    from alphallama.chat import ChatTemplate, chat_prompt_ids
    from alphallama.gguf.reader import GGUFFile
    tmpl = ChatTemplate.from_gguf_metadata(GGUFFile(model).metadata)
    return chat_prompt_ids(tmpl, tok, [{"role": "user", "content": text}], True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--langs", default=DEFAULT_LANGS, help=f"comma-separated, from {','.join(PROMPTS)}")
    ap.add_argument("--tokens", type=int, default=24, help="greedy output tokens per language")
    ap.add_argument("--sizes", default=None, help="draft vocabulary sizes, comma-separated (default: see code)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--rescore", default=None,
                    help="a result of this script: score its outputs again (no generation, no weights loaded)")
    args = ap.parse_args()
    langs = args.langs.split(",")
    unknown = [lang for lang in langs if lang not in PROMPTS]
    if unknown:
        ap.error(f"no prompt for {unknown} (have {', '.join(PROMPTS)})")

    host = host_state(sys.argv)
    t0 = time.perf_counter()
    old = json.loads(Path(args.rescore).read_text()) if args.rescore else None
    if old is not None:   # the tokenizer alone; outputs and prompts from the old run
        eng = None
        tok = Tokenizer.from_gguf(args.model)
        saved = {r["lang"]: r for r in old["languages"]}
        langs = list(saved)
    else:
        eng = Engine.load(args.model, ctx_size=args.ctx, device=args.device)
        tok = eng.tokenizer
    dv = DraftVocab.from_tokenizer(tok)
    V = dv.size
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else default_sizes(V)
    print(f"loaded in {time.perf_counter() - t0:.1f} s; vocabulary {V}, classes {dv.counts()}", flush=True)

    rows = []
    for lang in langs:
        if old is not None:
            ids = saved[lang].get("prompt_ids") or chat_ids(args.model, tok, saved[lang]["prompt"])
            out, tps = saved[lang]["output_ids"], saved[lang]["decode_tok_s"]
        else:
            ids = eng.encode_chat([{"role": "user", "content": PROMPTS[lang]}])
            gen = Generation()
            out = list(eng.generate(ids, args.tokens, gen=gen))
            tps = gen.stats.predicted_per_second
        scripts = prompt_scripts(tok.decode(ids, special=False))
        row = {"lang": lang, "prompt": PROMPTS[lang], "prompt_ids": ids, "scripts": scripts, "n_tokens": len(out),
               "output_ids": out, "output_text": tok.decode(out), "decode_tok_s": tps,
               "output_classes": {}, "sizes": {}}
        for t in out:
            c = dv.names[dv.classes[t]]
            row["output_classes"][c] = row["output_classes"].get(c, 0) + 1
        arr = np.array(out, dtype=np.int64)
        for n in sizes:
            fixed = np.isin(arr, dv.fixed(n))
            adaptive = np.isin(arr, dv.subset(scripts, n))
            row["sizes"][str(n)] = {
                "fixed_impossible": float(1 - fixed.mean()) if len(arr) else 0.0,
                "adaptive_impossible": float(1 - adaptive.mean()) if len(arr) else 0.0}
        rows.append(row)
        cells = "  ".join(f"N={n}: fixed {row['sizes'][str(n)]['fixed_impossible']:.0%} "
                          f"adaptive {row['sizes'][str(n)]['adaptive_impossible']:.0%}" for n in sizes)
        print(f"{lang}  {len(out):3d} tok  scripts {scripts}  {cells}  | {row['output_text'][:60]!r}", flush=True)

    result = {
        "bench": "draft_vocab_share", "host": host, "commit": os.environ.get("GIT_COMMIT") or host["git"]["commit"],
        "model": os.path.basename(args.model), "vocab_size": V,
        "device": old["device"] if old else str(eng.cache.k.device),
        "outputs_generated_at": {"commit": old["commit"], "date": old["host"]["date"]} if old else None,
        "classes": dv.counts(), "sizes": sizes,
        "tokens_per_language": old["tokens_per_language"] if old else args.tokens,
        "definition": "share of the greedy output tokens outside the N scored rows (those can never be drafted); "
                      "fixed = ids 0..N-1, adaptive = DraftVocab.subset(prompt scripts, N)",
        "languages": rows,
        "summary": {str(n): {r["lang"]: [r["sizes"][str(n)]["fixed_impossible"], r["sizes"][str(n)]["adaptive_impossible"]]
                             for r in rows} for n in sizes},
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    stem = Path(args.model).name.removesuffix(".gguf")
    path = Path(args.out) / f"draft_vocab_share-{stem}-{datetime.date.today():%Y%m%d}.json"
    path.write_text(json.dumps(result, indent=1, ensure_ascii=False))
    print(f"wrote {path}")
    print(f"{'lang':5} " + " ".join(f"{'N=' + str(n) + ' fixed/adaptive':>26}" for n in sizes))
    for r in rows:
        print(f"{r['lang']:5} " + " ".join(f"{r['sizes'][str(n)]['fixed_impossible']:>13.1%}/"
                                          f"{r['sizes'][str(n)]['adaptive_impossible']:<12.1%}" for n in sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
