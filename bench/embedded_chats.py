"""The embedded model's answers to short Python requests in chat, scored as the training
evaluation scores its four sample chats (train/evaluate.py: does the answer define a function,
is it plausible (names.py: its functions read only builtins and names the answer binds), the
repeated share of 6-word windows), but over 24 everyday requests, so that two models' rates
are not decided by one or two answers. Greedy, the engine on the CPU, each model in turn.

    PYTHONPATH=src python bench/embedded_chats.py [--before OLD.gguf] [--after NEW.gguf] \
        [--max-tokens 160] [--out bench/results]
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import time
from pathlib import Path

from alphallama.engine import Engine
from alphallama.train.names import plausible
from alphallama.train.quality import answer_code, defines_function, repeat_share

REQUESTS = (
    "Write a Python function that reverses a string.",
    "Write a Python function that returns True if a string is a palindrome, ignoring case and spaces.",
    "Write a Python function that counts the words in a text file.",
    "Write a Python function to compute the factorial of n.",
    "Write a Python function that returns the largest number in a list.",
    "Write a Python function that removes duplicate items from a list, keeping their order.",
    "Write a Python function that returns the sum of the squares of a list of numbers.",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that merges two dictionaries.",
    "Write a Python function that flattens a list of lists.",
    "Write a Python function that reads a JSON file and returns its contents.",
    "Write a Python function that converts a temperature from Celsius to Fahrenheit.",
    "Write a Python function that returns the average of a list of numbers.",
    "Write a Python function that splits a list into chunks of size n.",
    "Write a Python function that capitalizes the first letter of every word in a string.",
    "Write a Python function that returns the keys of a dictionary sorted by their values.",
    "Write a Python function that checks whether two strings are anagrams.",
    "Write a Python function that returns the greatest common divisor of two integers.",
    "Write a Python function that lists the files in a directory.",
    "Write a Python function that counts how often each character occurs in a string.",
    "Write a Python function that returns the index of an item in a sorted list using binary search.",
    "Write a Python function that strips whitespace from every line of a text.",
)


def score(model: str, max_tokens: int) -> dict:
    engine = Engine.load(model, device="cpu")
    rows, t0 = [], time.time()
    for req in REQUESTS:
        ids = engine.encode_chat([{"role": "user", "content": req}])
        out = engine.tokenizer.decode(list(engine.generate(ids, max_tokens)))
        code = answer_code(out)
        rows.append({"request": req, "output": out, "defines_function": defines_function(code),
                     "plausible": plausible(code), "repeat_share": repeat_share(out)})
    n = len(rows)
    return {"model": model, "seconds": round(time.time() - t0, 1),
            "defines_function": sum(r["defines_function"] for r in rows),
            "plausible": sum(r["plausible"] for r in rows),
            "mean_repeat_share": round(sum(r["repeat_share"] for r in rows) / n, 3),
            "looping": sum(r["repeat_share"] > 0.5 for r in rows), "requests": n, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="src/alphallama/data/alphallama-embedded.gguf")
    ap.add_argument("--after", default=None)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    sides = {"before": a.before} | ({"after": a.after} if a.after else {})
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip(),
           "command": "python bench/embedded_chats.py " + " ".join(f"--{k} {v}" for k, v in sides.items()),
           "method": "greedy, engine on the CPU; defines_function / plausible / repeat_share as train/evaluate.py",
           "max_tokens": a.max_tokens}
    for side, model in sides.items():
        res[side] = score(model, a.max_tokens)
        s = res[side]
        print(f"{side:7s} defines {s['defines_function']}/{s['requests']}  plausible {s['plausible']}/{s['requests']}"
              f"  looping (>0.5) {s['looping']}  mean repeat {s['mean_repeat_share']}  ({s['seconds']} s)", flush=True)
    out = Path(a.out) / f"embedded_chats-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
