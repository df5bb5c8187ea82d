"""Continued training from a model already made: `train run --init-from MODEL.gguf`.

The run keeps what the model knows and changes how it answers: the shipped embedded model
(and its MTP sidecar, `<stem>.mtp.gguf`) is read back into the training modules, its
tokenizer is reused (not trained again, so every token id keeps its meaning), and the
schedule starts afresh over this call's budget with the learning rate the caller gives
(docs/decisions/embedded-model.md, "A second phase from the shipped model").

    start = read_start("alphallama-embedded.gguf")
    model, head = MoEModel(start.cfg), MTPHead(MTPConfig.from_model(start.cfg.model_config(), start.mtp_d_ff))
    start.load_into(model, head)
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from ..gguf.arch import find_mtp_head, load_config
from ..gguf.quants import as_bytes, dequantize
from ..gguf.reader import GGUFFile
from ..tokenizer import hf_pre_tokenizer, pre_tokenizer
from .bpe import PRE, SPECIALS
from .model import MoEConfig, MoEModel
from .mtp import MTPHead
from .parts import sha256_file


@dataclass
class Start:
    path: str
    sha256: str
    cfg: MoEConfig
    mtp_d_ff: int
    tokenizer: HFTokenizer
    mtp_path: str

    def load_into(self, model: MoEModel, head: MTPHead) -> None:
        """Every parameter of the model and the head from the files (dequantized to
        float32); a missing tensor or another shape is an error, never a silent init."""
        _copy(GGUFFile(self.path), model.gguf_params())
        _copy(GGUFFile(self.mtp_path), head.gguf_params(self.cfg.n_layers))

    def record(self) -> dict:
        return {"file": os.path.basename(self.path), "sha256": self.sha256,
                "mtp_file": os.path.basename(self.mtp_path), "mtp_sha256": sha256_file(self.mtp_path)}


@torch.no_grad()
def _copy(f: GGUFFile, params: dict[str, torch.Tensor]) -> None:
    for name, p in params.items():
        t = f.tensors.get(name)
        if t is None:
            raise ValueError(f"{f.path}: no tensor {name}")
        w = dequantize(as_bytes(t.data), t.qtype, t.shape)
        if tuple(w.shape) != tuple(p.shape):
            raise ValueError(f"{f.path}: {name} is {tuple(w.shape)}, the training model's is {tuple(p.shape)}")
        p.copy_(w.to(p.dtype))


def tokenizer_from_gguf(md: dict, path: str) -> HFTokenizer:
    """The file's byte-level BPE (tokens, merges) as a `tokenizers` object with the
    trainer's pre-tokenizer and special tokens: bpe.train_bpe's kind, ids unchanged."""
    if md.get("tokenizer.ggml.model") != "gpt2" or md.get("tokenizer.ggml.pre") != PRE:
        raise ValueError(f"{path}: not a byte-level BPE with the {PRE!r} pre-tokenizer "
                         "(only a model this trainer made can be trained further)")
    tokens, merges = list(md["tokenizer.ggml.tokens"]), list(md["tokenizer.ggml.merges"])
    missing = [s for s in SPECIALS if s not in tokens]
    if missing:
        raise ValueError(f"{path}: the vocabulary lacks the special tokens {missing}")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs))
    tok.pre_tokenizer = hf_pre_tokenizer(pre_tokenizer(PRE))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))                 # already in the vocabulary: ids kept
    if tok.get_vocab_size() != len(tokens):
        raise ValueError(f"{path}: the vocabulary did not rebuild ({tok.get_vocab_size()} of {len(tokens)} ids)")
    return tok


def _decimal(x: float) -> float:
    """The shortest decimal of a float32 metadata value (1e-06, not 9.99999997e-07): the
    number the trainer was given, so the continued run's config is the first run's."""
    return float(str(np.float32(x)))


def read_start(path: str | Path) -> Start:
    """The model to continue from, its MTP head (sidecar or in-file) and its tokenizer."""
    path = str(path)
    f = GGUFFile(path)
    cfg = load_config(f)
    if cfg.arch != "qwen3moe" or not cfg.is_moe:
        raise ValueError(f"{path}: {cfg.arch} is not the trainer's architecture (qwen3moe)")
    found = find_mtp_head(f, cfg)
    if found is None or found[1].moe or not found[1].sidecar:
        raise ValueError(f"{path}: no dense MTP sidecar beside it ({Path(path).stem}.mtp.gguf)")
    head_cfg = found[1]
    mc = MoEConfig(vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                   n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, n_experts=cfg.n_experts,
                   n_experts_used=cfg.n_experts_used, d_ff_expert=cfg.d_ff_expert, ctx_len=cfg.ctx_len,
                   norm_eps=_decimal(cfg.norm_eps), rope_base=_decimal(cfg.rope_base))
    return Start(path, sha256_file(path), mc, head_cfg.d_ff, tokenizer_from_gguf(f.metadata, path), head_cfg.path)
