"""The MTP drafter: the model's own multi-token-prediction head drafts 1..5 tokens per
round from the last verified hidden state (docs/MTP.md).

Three pieces:
- `MTPState`, one per engine slot (it outlives requests, like the slot's KV rows): the
  head, the slot's one-layer MTP cache and which tokens that cache's entries were made
  for, so prefix re-use keeps both caches consistent. The engine hands it the slot's
  main-model hidden states: prefill rows as they are computed, and after each verify
  round the rows of the committed tokens, which wait ("staged") until the next draft
  makes their entries in the same pass as the chain. Rounds that do not draft (the
  policy switched MTP off, spec/policy.py) add to the staged rows instead of extending
  the cache each round; a later draft, or `STAGE_MAX` rows, makes them in one batch.
  With parallel streams (`-np N`) every slot has its own state over one shared head
  (`slot_states`: the head's `new_caches`, one cache of N slots on the GPU), so a
  stream's drafts depend on its own history only; each stream runs its own chain.
- `HeadVocab`, shared by the slots' states: the draft vocabulary the head scores. The
  head holds one set of rows at a time, so each state asks for its prompt's before its
  chain (a copy of the rows only when the last chain was another script's).
- `MTPDrafter`, one per request (the Drafter protocol of spec/drafter.py): picks the
  draft vocabulary from the prompt's scripts and, each round, runs the chain and stops
  before the first draft whose probability is under min-p.

Entry p of the MTP cache is made from g = h_{p-1} (zeros at p = 0) and x_p, so it
depends on the tokens x_0..x_p: `seq` holds them, and an entry stays valid for a new
prompt while the prompt agrees with `seq` up to its position.
"""
from __future__ import annotations

import torch

from ..config import DEFAULTS
from .drafter import Draft, common_prefix
from .draft_vocab import DraftVocab, prompt_scripts

STAGE_MAX = 64      # staged rows that make their entries at once, drafted or not (bounds what is held)


class HeadVocab:
    """The output rows the head scores (spec/draft_vocab.py), for every slot's state."""

    def __init__(self, head, tokenizer, size: int = DEFAULTS.mtp.draft_vocab):
        self.head, self.tokenizer, self.size = head, tokenizer, size
        self._vocab: DraftVocab | None = None
        self.key: tuple[str, ...] | None = None     # the scripts whose rows the head scores (None: as loaded)
        if size < head.cfg.vocab_size:
            # classify the vocabulary now (~2 s for 150k tokens) rather than in the first request, and
            # score the first-N rows until a request picks its own: the GPU head's buffer keeps its size
            self._vocab = DraftVocab.from_tokenizer(tokenizer)
            head.set_vocab(torch.arange(size))

    def key_for(self, prompt_ids: list[int]) -> tuple[str, ...] | None:
        """The prompt's scripts; None when the head scores the whole vocabulary (it is small)."""
        if self.size >= self.head.cfg.vocab_size:
            return None
        return tuple(prompt_scripts(self.tokenizer.decode(prompt_ids, special=False)))

    def use(self, key: tuple[str, ...] | None) -> None:
        """Make the head score the rows of these scripts (None: leave it as it is)."""
        if key is None or key == self.key:
            return
        if self._vocab is None:
            self._vocab = DraftVocab.from_tokenizer(self.tokenizer)
        self.head.set_vocab(torch.from_numpy(self._vocab.subset(list(key), self.size)))
        self.key = key


class MTPState:
    def __init__(self, head, ctx_size: int, tokenizer, draft_vocab: int = DEFAULTS.mtp.draft_vocab, *,
                 cache=None, vocab: HeadVocab | None = None):
        """head: model.mtp.MTPHead (CPU reference) or runtime.gpu_mtp.GPUMTPHead. cache: this
        slot's MTP cache (None: a new one, the head's whole); vocab: the slots' shared
        draft vocabulary (None: a new one, of draft_vocab rows)."""
        self.head = head
        self.cache = cache if cache is not None else head.new_cache(ctx_size)
        self.vocab = vocab if vocab is not None else HeadVocab(head, tokenizer, draft_vocab)
        self.vocab_key: tuple[str, ...] | None = None    # this slot's request's scripts (choose_vocab)
        self.seq: list[int] = []        # x_0..x_{L-1} of the L permanent entries in the cache
        self.staged: list[tuple[torch.Tensor, list[int], int]] = []     # (g [m, D], tokens, first position)
        self.wanted = False             # the current request drafts with MTP (make_mtp_drafter sets it)

    @property
    def length(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.truncate(0)
        self.seq = []
        self.staged = []

    # -- prefill ---------------------------------------------------------------------
    def keep_rows(self, ids: list[int], common: int) -> int:
        """How many of the engine's `common` re-usable KV rows to keep for prompt `ids`
        so that the MTP entries can be continued: entry p needs h_{p-1}, so rows from
        the first entry to (re)make on are recomputed. Truncates the MTP cache to match
        and makes entry 0 when the cache starts empty."""
        self.flush()
        valid = min(self.length, common_prefix(self.seq, ids))     # entries 0..valid-1 hold
        keep = min(common, max(valid - 1, 0))
        n = keep + 1 if valid >= 1 else 0
        self.cache.truncate(n)
        self.seq = self.seq[:n]
        if n == 0:
            g = torch.zeros(1, self.head.cfg.d_model)               # no state before position 0
            self.head.extend(g, torch.tensor(ids[:1]), 0, self.cache)
            self.seq = ids[:1]
        return keep

    def feed(self, hidden: torch.Tensor, start: int, ids: list[int]) -> None:
        """Prefill rows start..start+T-1 were computed (hidden [T, D]): make entries
        start+1..start+T, whose tokens are in the prompt."""
        T = hidden.shape[0]
        if self.length != start + 1:
            raise RuntimeError(f"MTP cache holds {self.length} entries, prefill row {start} needs {start + 1}")
        self.head.extend(hidden, torch.tensor(ids[start + 1:start + T + 1]), start + 1, self.cache)
        self.seq = ids[:start + T + 1]

    # -- decoding --------------------------------------------------------------------
    def stage(self, hidden: torch.Tensor, pos: int, tokens: list[int]) -> None:
        """Main-model rows pos-1..pos+m-2 (hidden [m, D]) are committed and followed by
        `tokens` [m]: their entries pos..pos+m-1 are made by the next draft (or flush)."""
        end = self.staged[-1][2] + len(self.staged[-1][1]) if self.staged else self.length
        if pos != end:
            raise RuntimeError(f"MTP cache holds {self.length} entries and rows staged up to {end}, "
                               f"staged rows start at {pos}")
        self.staged.append((hidden[:len(tokens)].clone(), list(tokens), pos))   # the verify output is reused
        if sum(len(t) for _, t, _ in self.staged) >= STAGE_MAX:
            self.flush()

    def _take(self) -> tuple[torch.Tensor, list[int], int] | None:
        """Every staged row, as one block (and nothing staged any more)."""
        if not self.staged:
            return None
        parts, self.staged = self.staged, []
        g = parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts])
        return g, [t for p in parts for t in p[1]], parts[0][2]

    def flush(self) -> None:
        """Make the staged entries without drafting."""
        taken = self._take()
        if taken is not None:
            g, toks, pos = taken
            self.head.extend(g, torch.tensor(toks), pos, self.cache)
            self.seq.extend(toks)

    def draft(self, depth: int) -> tuple[list[int], list[float]]:
        """Make the staged entries and run a chain of `depth` drafts from the last one:
        (tokens, their probabilities). Nothing staged: no drafts."""
        taken = self._take()
        if taken is None:
            return [], []
        g, toks, pos = taken
        self.vocab.use(self.vocab_key)             # another slot's chain may have scored other rows
        out = self.head.draft(g, torch.tensor(toks), pos, depth, self.cache)
        self.seq.extend(toks)
        return out

    # -- draft vocabulary --------------------------------------------------------------
    def choose_vocab(self, prompt_ids: list[int]) -> list[str]:
        """Score the rows of the prompt's scripts (the whole vocabulary when it is small)."""
        self.vocab_key = self.vocab.key_for(prompt_ids)
        self.vocab.use(self.vocab_key)
        return list(self.vocab_key or ())


class MTPDrafter:
    name = "mtp"

    def __init__(self, state: MTPState, depth: int, min_p: float):
        if not 1 <= depth <= DEFAULTS.mtp.max_depth:
            raise ValueError(f"MTP draft depth must be in 1..{DEFAULTS.mtp.max_depth}, got {depth}")
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"MTP min-p must be in 0..1, got {min_p}")
        self.state, self.depth, self.min_p = state, depth, min_p
        # the whole chain of the last round, before the min-p stop (for the policy and stats)
        self.last_tokens: list[int] = []
        self.last_probs: list[float] = []

    def begin(self, prompt_ids: list[int]) -> None:
        self.state.choose_vocab(prompt_ids)

    def propose(self, max_n: int) -> Draft:
        toks, probs = self.state.draft(self.depth)
        self.last_tokens, self.last_probs = toks, probs
        n = 0
        while n < min(len(toks), max_n) and probs[n] >= self.min_p:
            n += 1
        return Draft(toks[:n], self.name, probs=tuple(probs[:n]))

    def accept(self, tokens: list[int]) -> None:
        """Nothing to do: the engine stages the verify pass's hidden rows in the state."""


def make_mtp_drafter(engine, depth: int, min_p: float, state: MTPState | None = None) -> MTPDrafter:
    """The MTP drafter for one request of `engine` on its slot's `state` (None: the engine's
    first slot's); ValueError if its model has no MTP head."""
    state = state if state is not None else getattr(engine, "mtp", None)
    if state is None:
        where = f" {engine.gguf.path}" if engine is not None else ""
        raise ValueError(f"--spec-type mtp needs a model with an MTP head, and the model{where} has none "
                         f"(an in-file head with nextn_predict_layers, a '<model>.mtp.gguf' sidecar next to "
                         f"the model, or --draft-head FILE)")
    drafter = MTPDrafter(state, depth, min_p)
    prepare = getattr(state.head, "prepare", None)
    if prepare is not None:      # the GPU head captures its graphs for this depth once
        prepare(depth, state.cache)
    state.wanted = True
    return drafter


def slot_states(head, ctx_size: int, tokenizer, slots: int = 1,
                draft_vocab: int = DEFAULTS.mtp.draft_vocab) -> list[MTPState]:
    """Each of `slots` engine slots' state over one head: its own cache (the head's
    new_caches), one draft vocabulary for all."""
    caches = head.new_caches(ctx_size, slots)
    vocab = HeadVocab(head, tokenizer, draft_vocab)
    return [MTPState(head, ctx_size, tokenizer, cache=c, vocab=vocab) for c in caches]


def load_mtp_states(head_file, hc, model, ctx_size: int, tokenizer, slots: int = 1) -> list[MTPState]:
    """The MTP head of `hc` (arch.find_mtp_head) on the model's runtime, a state per slot:
    the reference block beside the reference Transformer (the hybrids' beside
    HybridTransformer), the GPU block beside a GPUModel (the hybrids' beside GPUHybridModel)."""
    from ..model.mtp import MTPHead
    from ..model.qwen35 import HybridTransformer
    from ..model.qwen35_mtp import HybridMTPHead
    from ..model.transformer import Transformer
    if isinstance(model, Transformer):
        head = MTPHead.load(head_file, hc, model, ctx_size)
    elif isinstance(model, HybridTransformer):   # the hybrids' own block (model/qwen35_mtp.py)
        head = HybridMTPHead.load(head_file, hc, model, ctx_size)
    else:                                        # the GPU runtime: GPUModel or GPUHybridModel
        from ..runtime.gpu_hybrid import GPUHybridModel
        from ..runtime.gpu_mtp import GPUMTPHead
        from ..runtime.hybrid_mtp import GPUHybridMTPHead
        head = (GPUHybridMTPHead if isinstance(model, GPUHybridModel) else GPUMTPHead)(model, head_file, hc, ctx_size)
    states = slot_states(head, ctx_size, tokenizer, slots)
    prepare = getattr(head, "prepare", None)
    if prepare is not None:      # capture at load, as the model does, for the default depth (every slot's)
        prepare(DEFAULTS.spec.mtp_depth, states[0].cache)
    return states
