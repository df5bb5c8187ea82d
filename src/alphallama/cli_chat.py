"""`alphallama run -cnv`: an interactive conversation, as llama-cli's conversation mode.

Each line read is a user turn; the whole conversation goes through the model's chat
template every turn, and the engine re-uses the cached rows of the turns before (its
prefix re-use), so a turn costs only its own tokens. As in llama-cli, `-p` (if given) is
the system message. End of input (Ctrl-D) ends the conversation.
"""
from __future__ import annotations

import sys


def chat_loop(engine, spec, sampling, n_predict: int, system: str | None, inp=None, out=None) -> int:
    """Read turns from `inp` until end of input, stream each reply to `out`; 0, or 2
    (one line on stderr) when the template refuses the conversation or it outgrows the context."""
    import jinja2

    from .engine import Generation
    inp = sys.stdin if inp is None else inp
    out = sys.stdout if out is None else out
    interactive = inp.isatty()
    messages = [{"role": "system", "content": system}] if system else []
    tok = engine.tokenizer
    while True:
        if interactive:
            out.write("> ")
            out.flush()
        line = inp.readline()
        if not line:
            return 0
        text = line.rstrip("\n")
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        try:
            ids = engine.encode_chat(messages)
        except (ValueError, jinja2.TemplateError) as e:
            print(f"alphallama: error: the chat template: {e}", file=sys.stderr)
            return 2
        gen, stream = Generation(), tok.stream()
        try:
            for t in engine.generate(ids, n_predict, sampling, gen=gen, spec=spec):
                piece = stream.feed(t)
                if piece:
                    out.write(piece)
                    out.flush()
        except ValueError as e:     # the conversation no longer fits the context
            print(f"\nalphallama: error: {e}", file=sys.stderr)
            return 2
        out.write(stream.flush() + "\n")
        out.flush()
        messages.append({"role": "assistant", "content": tok.decode(gen.tokens, continuation=True)})
