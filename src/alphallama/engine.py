"""Engine: the scheduler behind the CLI and the server.

It owns one model, its KV cache in slots (engine_slots.py: one by default, N for
parallel streams) and the tokens whose rows each slot holds, so a new request that
shares a prefix with an earlier conversation re-uses those rows instead of prefilling
them again. `stream` is one request's loop body (a generator the drivers advance):
`generate` drives one stream alone, streams.Streams several in shared rounds.
"""
from __future__ import annotations

import time
from dataclasses import replace
from functools import cached_property
from typing import TYPE_CHECKING, Callable, Generator, Iterator

import torch

from .config import DEFAULTS
from .engine_models import build_model, resolve_device  # noqa: F401 (resolve_device: re-exported)
from .engine_slots import CHUNK, Chunk, Slot, Verify, choose_slot, drain, new_slots, slot_context
from .generation import GenStats, Generation, _logprobs  # noqa: F401 (re-exported: engine.Generation)
from .gguf.arch import ModelConfig
from .gguf.reader import GGUFFile
from .model.layers import rms_norm
from .penalties import Penalties, shape_rows
from .sampling import Sampler, SamplingParams
from .spec.config import SpecConfig
from .spec.allot import Claim, Seat, allot, cut
from .spec.drafter import NO_DRAFT
from .spec.policy import offer, seated
from .spec.verify import greedy_accept, speculative_sample

if TYPE_CHECKING:   # llguidance is imported only when a request brings a grammar
    from .grammar import GrammarVocab, TokenConstraint


# Prompt texts up to this many characters are tokenized whatever the context, to count
# their tokens exactly (about half a second of tokenizing on one core).
TOKENIZE_ANYWAY_CHARS = 1 << 20


class ContextOverflow(ValueError):
    """A prompt that does not fit the context; the message says by how much."""


class Engine:
    def __init__(self, gguf: GGUFFile, model, tokenizer, chat_template, ctx_size: int, mtp=None,
                 slots: int = 1):
        """ctx_size: each slot's context; slots: parallel streams' slots (one: the single stream);
        mtp: the MTP head's state of each slot (spec.mtp.MTPState: a list of `slots`, or one for
        one slot; spec.mtp.slot_states makes them), None: no head."""
        self.gguf = gguf
        self.model = model
        self.cfg: ModelConfig = model.cfg
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.ctx_size = ctx_size
        self.slots: list[Slot] = new_slots(model, ctx_size, slots, mtp)
        self._uses = 0                 # the slots' LRU clock
        self._output_norm_w: torch.Tensor | None = None   # read on the first embedding

    @property
    def cache(self):
        """The first slot's cache (with one slot, the engine's)."""
        return self.slots[0].cache

    @cache.setter
    def cache(self, cache) -> None:
        self.slots[0].cache = cache

    @property
    def mtp(self):
        """The first slot's MTP state (spec.mtp.MTPState; None: the model has no MTP head)."""
        return self.slots[0].mtp

    @property
    def cached(self) -> list[int]:
        """The tokens whose K/V rows are committed in the first slot's cache."""
        return self.slots[0].cached

    @cached.setter
    def cached(self, ids: list[int]) -> None:
        self.slots[0].cached = ids

    def take_slot(self, ids: list[int], slot: Slot | None = None) -> Slot:
        """Mark `slot` (None: choose_slot's for ids) busy and most recently used."""
        slot = slot if slot is not None else choose_slot(self.slots, ids)
        if slot.busy:
            raise ValueError(f"slot {slot.id} is busy")
        self._uses += 1
        slot.busy, slot.used = True, self._uses
        return slot

    def reset_slot(self, slot: Slot) -> None:
        """Forget one slot's conversation (its contents are unknown after a failure), its MTP
        entries too."""
        slot.cache.truncate(0)
        slot.cached = []
        if slot.mtp is not None:
            slot.mtp.reset()

    @classmethod
    def load(cls, path: str, ctx_size: int | None = None, device: str = DEFAULTS.engine.device,
             progress: Callable[[str, int], None] | None = None, draft_head: str | None = None,
             expert_slots: int | None = None, cpu_threads: int | None = None, fast: bool = False,
             weights_read: Callable[[], None] | None = None, host_bytes: int | None = None,
             slots: int = 1, miss_rates=None) -> "Engine":
        """draft_head: an MTP head GGUF (else the model's own, or `<stem>.mtp.gguf` beside it).
        expert_slots: an MoE model's experts in an expert store with this many VRAM slots
        (offload/; the automatic plan sets it), None: all resident. cpu_threads: the store's
        CPU expert workers (None: the probe's count). host_bytes: the store's pinned RAM (the
        experts past it read from the mapped file; None: all in RAM). fast: the engine serves fast mode (--fast):
        on the GPU its wide verify rounds may take the tensor cores (GPUModel's `fast`).
        weights_read: called once the model's weights are in place, before the rest is built
        (the MTP head, the KV cache and, on the GPU, its CUDA graphs): a progress display's
        boundary between the two. slots: parallel streams (-np), each slot ctx_size / slots rows
        (llama-server's split). miss_rates: with a store, what a missed expert costs a round (the
        plan's estimate.MissRates; the speculation gate prices a column's misses with them)."""
        from .chat import ChatTemplate
        from .gguf.arch import find_mtp_head, load_config
        from .spec.mtp import load_mtp_states
        from .tokenizer import Tokenizer
        f = GGUFFile(path)
        cfg = load_config(f)
        ctx = slot_context(min(ctx_size or DEFAULTS.engine.ctx_size, cfg.ctx_len), slots)
        tok = Tokenizer.from_metadata(f.metadata)
        tmpl = ChatTemplate.from_gguf_metadata(f.metadata, fallback=None)   # ChatML fallback only when used
        model = build_model(f, cfg, ctx, device, progress, expert_slots, cpu_threads, fast, host_bytes, miss_rates)
        if weights_read is not None:
            weights_read()
        head = find_mtp_head(f, cfg, draft_head)
        mtp = load_mtp_states(*head, model, ctx, tok, slots) if head is not None else None   # one per slot
        return cls(f, model, tok, tmpl, ctx, mtp, slots)

    @cached_property
    def grammar_vocab(self) -> "GrammarVocab":
        """The vocabulary as the grammar library sees it (built at the first constrained request)."""
        from .grammar import GrammarVocab
        return GrammarVocab(self.tokenizer, self.cfg.vocab_size)

    def reset(self) -> None:
        """Forget the cached conversations: the next prompt is prefilled whole."""
        for slot in self.slots:
            self.reset_slot(slot)

    # -- prompts ----------------------------------------------------------------------
    def encode_prompt(self, text: str) -> list[int]:
        self.check_text_fits(text)
        return self.tokenizer.encode(text, add_special=True, parse_special=False)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kw) -> list[int]:
        from .chat import ChatTemplate, chat_prompt_text
        if self.chat_template is None:
            self.chat_template = ChatTemplate.from_gguf_metadata(self.gguf.metadata)
        text = chat_prompt_text(self.chat_template, self.tokenizer, messages, add_generation_prompt, **kw)
        self.check_text_fits(text)
        return self.tokenizer.encode(text, add_special=True, parse_special=True)

    @property
    def max_prompt_chars(self) -> int:
        """The longest prompt text worth tokenizing: no token spells more than
        max_piece_bytes bytes, so a longer text cannot fit the context whatever its
        tokens. Never below TOKENIZE_ANYWAY_CHARS, so that ordinary overflows are told
        their exact token count."""
        return max(self.ctx_size * self.tokenizer.max_piece_bytes, TOKENIZE_ANYWAY_CHARS)

    def check_text_fits(self, text: str) -> None:
        """Refuse a text too long for the context before tokenizing it: a huge string
        never reaches the tokenizer, which takes seconds on megabytes and aborts the
        process on more."""
        if len(text) > self.max_prompt_chars:
            raise ContextOverflow(f"the prompt has {len(text)} characters, more than a context of {self.ctx_size} "
                                  f"tokens can hold (at most {self.tokenizer.max_piece_bytes} characters a token)")

    def check_fits(self, n_prompt: int) -> None:
        if n_prompt >= self.ctx_size:
            raise ContextOverflow(f"the prompt has {n_prompt} tokens but the context holds "
                                  f"{self.ctx_size} (at least one more is needed to generate)")
        if n_prompt == 0:
            raise ValueError("the prompt is empty")

    # -- generation -------------------------------------------------------------------
    def prefill(self, ids: list[int], stats: GenStats, cancel: Callable[[], bool] | None = None,
                mtp: bool = False, slot: Slot | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Make a slot (None: the one choose_slot picks for ids) hold `ids`, re-using the
        longest common prefix; (logits, hidden state) of the last row. mtp: also make the
        slot's MTP entries for the prompt (re-using only rows that keep its cache consistent).

        The last prompt row always goes through the W = 1 decode path, alone: the
        logits that choose the first token then come from the same arithmetic as every
        later token, and a repeated request (which re-uses all rows but that one)
        computes it exactly as the first time did, so it gets the same output.
        `cancel()` is asked before each chunk; if it says so, prefill stops (the cache
        keeps the rows done so far) and None is returned."""
        own = slot is None
        slot = self.take_slot(ids) if own else slot
        try:
            return drain(self._prefill_steps(slot, ids, stats, cancel, mtp))
        finally:
            if own:
                slot.busy = False

    def _prefill_steps(self, slot: Slot, ids: list[int], stats: GenStats, cancel: Callable[[], bool] | None,
                       mtp: bool) -> Generator[Chunk, None, tuple[torch.Tensor, torch.Tensor] | None]:
        """prefill's work, yielding CHUNK after each prompt chunk; returns what prefill does."""
        t0 = time.perf_counter()
        cache = slot.cache
        common = 0
        for a, b in zip(slot.cached, ids):
            if a != b:
                break
            common += 1
        common = cache.restorable(min(common, len(ids) - 1))   # a recurrent state returns to few points
        head = slot.mtp if mtp else None
        if head is not None:
            common = head.keep_rows(ids, common)
            while cache.restorable(common) != common:   # a hybrid: back to a point its state holds
                common = head.keep_rows(ids, cache.restorable(common))
        cache.truncate(min(common, cache.length))
        slot.cached = ids[:common]
        chunk = DEFAULTS.engine.prefill_chunk
        for s in range(common, len(ids) - 1, chunk):
            if cancel is not None and cancel():
                return None
            part = ids[s:min(s + chunk, len(ids) - 1)]
            _, hidden = self.model.forward(torch.tensor(part), s, cache, logits=False)
            if head is not None:
                head.feed(hidden, s, ids)
            slot.cached = ids[:s + len(part)]
            yield CHUNK
        cache.checkpoint()        # the prompt boundary: where a hybrid's next turn continues from
        logits, hidden = self.model.forward(torch.tensor(ids[-1:]), len(ids) - 1, cache)
        slot.cached = list(ids)
        stats.prompt_reused = common
        stats.prompt_n = len(ids) - common
        stats.prompt_ms = 1000 * (time.perf_counter() - t0)
        return logits[-1], hidden[-1:]

    def generate(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams = SamplingParams(),
                 stop_ids: set[int] | None = None, gen: Generation | None = None,
                 spec: SpecConfig = SpecConfig(), logprobs: int | None = None,
                 cancel: Callable[[], bool] | None = None,
                 constraint: "TokenConstraint | None" = None, slot: Slot | None = None) -> Iterator[int]:
        """Yield generated token ids as decode rounds commit them; `gen` (if given)
        receives tokens, stats and finish_reason. Stops at an end-of-generation token
        (not yielded), at max_tokens, or when the context is full.

        Each round forwards the last committed token plus the drafts (W rows), accepts
        the longest agreeing prefix plus a bonus token, and rolls the cache back past it.
        With no drafter every round has W = 1: plain decoding is the same loop.
        logprobs=k records each token's log-probability and the top k (0: just its own).
        cancel() is polled between prefill chunks (a long prompt can be abandoned);
        during decoding, closing the generator is the way to stop.
        constraint: a grammar (grammar.py) every emitted token obeys: drafts are cut at the
        first token it rejects and each verify row is masked under its state, so exact mode
        still equals plain constrained greedy; sampling's logit_bias and penalties
        (penalties.py) count each row's history the same way. slot: where it runs (None: choose_slot's).
        This drives `stream` alone: each of its rounds is the model's verify."""
        core = self.stream(prompt_ids, max_tokens, sampling, stop_ids, gen, spec, logprobs, cancel, constraint,
                           slot)
        try:
            msg = next(core)
            while True:
                if isinstance(msg, Verify):
                    msg = core.send(self.model.verify(msg.tokens, msg.pos, msg.cache, exact=msg.exact))
                elif isinstance(msg, Claim):           # alone in its rounds: the gate's width
                    msg = core.send(Seat(allot([msg])[0]))
                elif msg is CHUNK:
                    msg = next(core)
                else:
                    yield msg
                    msg = next(core)
        except StopIteration:
            return
        finally:
            core.close()

    def stream(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams = SamplingParams(),
               stop_ids: set[int] | None = None, gen: Generation | None = None,
               spec: SpecConfig = SpecConfig(), logprobs: int | None = None,
               cancel: Callable[[], bool] | None = None, constraint: "TokenConstraint | None" = None,
               slot: Slot | None = None) -> Generator[int | Chunk | Claim | Verify, tuple | int | None, None]:
        """One request's loop body (generate's arguments): yields its token ids, CHUNK after
        each prompt chunk, a Claim for each round its drafter drafted for (spec/allot.py; with
        or without drafts), to which the driver sends its Seat (how many drafts to verify, what
        shares the round), and Verify for each round, to which it sends the
        round's (logits [w, V], hidden [w, D]). slot: one the caller took (take_slot), else it takes
        choose_slot's; it frees the slot when it ends or is closed (a caller that closes it
        before its first step frees its slot itself)."""
        try:
            self.check_fits(len(prompt_ids))
            slot = slot if slot is not None else self.take_slot(prompt_ids)
            yield from self._decode(slot, prompt_ids, max_tokens, sampling, stop_ids, gen, spec, logprobs, cancel,
                                    constraint)
        finally:
            if slot is not None:
                slot.busy = False

    def _decode(self, slot: Slot, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams,
                stop_ids: set[int] | None, gen: Generation | None, spec: SpecConfig, logprobs: int | None,
                cancel: Callable[[], bool] | None, constraint: "TokenConstraint | None"):
        gen = gen if gen is not None else Generation()
        stop = self.tokenizer.stop_ids if stop_ids is None else stop_ids
        sampler = Sampler(sampling)
        penalties = Penalties.start(sampling, prompt_ids, self.cfg.vocab_size)   # logit_bias, repeat penalties
        if slot.mtp is not None:
            slot.mtp.wanted = False        # an MTP drafter (made next) asks for the slot's MTP cache
        drafter = spec.make_drafter(self, slot.mtp, slot=slot)
        mtp = slot.mtp if slot.mtp is not None and slot.mtp.wanted else None
        prompt = list(prompt_ids)
        out = yield from self._prefill_steps(slot, prompt, gen.stats, cancel, mtp is not None)
        if out is None:
            gen.finish_reason = "cancelled"
            return
        logits, hidden = out
        t0 = time.perf_counter()
        try:
            logits = shape_rows(logits[None], [], penalties, constraint)[0]
            to_emit = [sampler.sample(logits)]
            if mtp is not None:            # the last prompt row and the first token: MTP entry len(prompt)
                mtp.stage(hidden, len(prompt), to_emit)
            rows_logits = logits[None]                 # [n_emit, V]: the row that predicted each token
            if drafter is not None:
                drafter.begin(prompt + to_emit)
            while True:
                for j, t in enumerate(to_emit):
                    if t in stop:
                        gen.finish_reason = "stop"
                        return
                    if constraint is not None:
                        constraint.commit(t)
                    if penalties is not None:
                        penalties.commit(t)
                    if logprobs is not None:
                        gen.logprobs.append(_logprobs(rows_logits[j], t, logprobs))
                    gen.tokens.append(t)
                    gen.stats.predicted_n += 1
                    yield t
                    if len(gen.tokens) >= max_tokens:
                        gen.finish_reason = "length"
                        return
                pos = len(slot.cached)
                if pos + 1 >= self.ctx_size:
                    gen.finish_reason = "length"
                    return
                room = min(max_tokens - len(gen.tokens) - 1, self.ctx_size - pos - 1)
                draft, claim = offer(drafter, room) if drafter is not None and room > 0 else (NO_DRAFT, None)
                if claim is not None:      # the driver's seat: how many the round verifies (spec/allot.py),
                    seat = yield claim     # beside what (the policy prices its round in it)
                    draft = cut(draft, seat.drafts)
                    seated(drafter, seat)
                if constraint is not None and draft.tokens:      # a token the grammar rejects ends the draft
                    keep = constraint.valid_prefix(draft.tokens)
                    draft = replace(draft, tokens=draft.tokens[:keep], probs=draft.probs[:keep])
                rows = [to_emit[-1], *draft.tokens]
                logits, hidden = yield Verify(torch.tensor(rows), pos, slot.cache, not spec.fast)
                logits = shape_rows(logits, draft.tokens, penalties, constraint)   # row i after drafts[:i]
                if sampling.greedy:
                    to_emit = greedy_accept(draft.tokens, logits)
                else:
                    to_emit = speculative_sample(draft.tokens, logits, sampler)
                n_acc = len(to_emit) - 1
                rows_logits = logits
                slot.cache.truncate(pos + 1 + n_acc)
                slot.cached.extend(rows[:1 + n_acc])
                if mtp is not None:        # committed rows + the tokens after them: the next MTP entries
                    mtp.stage(hidden[:1 + n_acc], pos + 1, to_emit)
                if drafter is not None:
                    drafter.accept(to_emit)
                gen.spec.record(draft.source, len(draft), n_acc, len(to_emit), draft.match_len, draft.probs)
                gen.stats.rounds += 1
                gen.stats.draft_n += len(draft)
                gen.stats.draft_n_accepted += n_acc
        finally:
            gen.stats.predicted_ms = 1000 * (time.perf_counter() - t0)

    # -- embeddings -------------------------------------------------------------------
    def final_hidden(self, ids: list[int], cancel: Callable[[], bool] | None = None) -> torch.Tensor | None:
        """The final hidden state of every row of `ids` (after the output norm: what
        llama.cpp pools for embeddings), [T, D] float32 on the CPU; None if cancel() said so.

        The rows are computed from position 0 in prefill chunks, so they overwrite the
        cached conversation of the slot choose_slot picks; afterwards it holds `ids`, as if
        they had been a prompt."""
        if len(ids) > self.ctx_size:
            raise ContextOverflow(f"the input has {len(ids)} tokens but the context holds {self.ctx_size}")
        if not ids:
            raise ValueError("the input is empty")
        slot = self.take_slot(ids)
        try:
            slot.cache.truncate(0)        # (its MTP entries, if any, stay: they hold for their tokens)
            slot.cached = []
            chunk = DEFAULTS.engine.prefill_chunk
            rows = []
            for s in range(0, len(ids), chunk):
                if cancel is not None and cancel():
                    return None
                part = ids[s:s + chunk]
                _, hidden = self.model.forward(torch.tensor(part), s, slot.cache, logits=False)
                rows.append(hidden.float().cpu())
                slot.cached = ids[:s + len(part)]
        finally:
            slot.busy = False
        x = torch.cat(rows)                                                     # [T, D]
        return rms_norm(x, self._output_norm(), self.cfg.norm_eps)

    def _output_norm(self) -> torch.Tensor:
        """The output norm's weight [D] (float32, CPU), read from the file once."""
        if self._output_norm_w is None:
            from .gguf.quants import dequantize
            t = self.gguf.tensors["output_norm.weight"]
            self._output_norm_w = dequantize(t.data, t.qtype, t.shape).float().reshape(-1)
        return self._output_norm_w
