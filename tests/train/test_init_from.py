"""`train run --init-from`: a model this trainer made is read back (weights, MTP head,
tokenizer) as the reference model reads it, and a run that does not move the weights
exports the same tensors and tokenizer it started from."""
from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from alphallama.gguf.reader import GGUFFile
from alphallama.model.loader import load_model
from alphallama.tokenizer import Tokenizer
from alphallama.train.bpe import gguf_tokenizer_kv, train_bpe
from alphallama.train.export import export
from alphallama.train.init_from import read_start
from alphallama.train.instruct import chat_template_text
from alphallama.train.model import MoEConfig, MoEModel
from alphallama.train.mtp import MTPConfig, MTPHead

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CFG = MoEConfig(vocab_size=400, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                n_experts=2, n_experts_used=1, d_ff_expert=32, ctx_len=32)
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.chat_template")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny trained-shape model exported in Q8_0 with its sidecar."""
    texts = [(STDLIB / f).read_text() for f in ("textwrap.py", "shlex.py", "glob.py")]
    hf = train_bpe(texts, CFG.vocab_size)
    torch.manual_seed(0)
    model = MoEModel(CFG, std=0.1)
    head = MTPHead(MTPConfig.from_model(CFG.model_config(), 64))
    with torch.no_grad():
        for p in [*model.parameters(), *head.parameters()]:
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    d = tmp_path_factory.mktemp("init")
    main, side = export(d, "m", model, head, gguf_tokenizer_kv(hf, chat_template_text()), {}, QT.Q8_0)
    return main, side


def test_start_reads_what_the_reference_model_reads(made):
    main, side = made
    start = read_start(main)
    assert start.cfg == CFG and start.mtp_d_ff == 64 and Path(start.mtp_path) == side
    f = GGUFFile(str(main))
    kv = {k: v for k, v, *_ in gguf_tokenizer_kv(start.tokenizer, f.metadata["tokenizer.chat_template"])}
    for k in TOKENIZER_KEYS:                                  # the tokenizer round-trips, ids unchanged
        assert list(np.atleast_1d(f.metadata[k])) == list(np.atleast_1d(kv[k])), k
    text = (STDLIB / "json" / "decoder.py").read_text()[:3000] + "<|im_start|>user\nhi<|im_end|>\n"
    assert start.tokenizer.encode(text, add_special_tokens=False).ids == Tokenizer.from_gguf(str(main)).encode(text, parse_special=True)
    model, head = MoEModel(CFG), MTPHead(MTPConfig.from_model(CFG.model_config(), start.mtp_d_ff))
    start.load_into(model, head)
    ref = load_model(f, 32)
    for name, p in model.gguf_params().items():               # the stored (Q8_0-rounded) weights, exactly
        assert torch.equal(p.detach(), ref.w[name].float()), name
    ids = start.tokenizer.encode(text[:300]).ids[:24]
    want, _ = ref.forward(torch.tensor(ids), 0, ref.new_cache(32))          # [T, V]
    with torch.no_grad():
        hidden, _ = model(torch.tensor([ids]))
        got = model.logits(hidden)[0]
    assert (got - want).abs().max().item() < 1e-4
    side_f = GGUFFile(str(side))
    for name, p in head.gguf_params(CFG.n_layers).items():
        t = side_f.tensors[name]
        from alphallama.gguf.quants import as_bytes, dequantize
        assert torch.equal(p.detach(), dequantize(as_bytes(t.data), t.qtype, t.shape)), name


def test_a_run_that_moves_nothing_exports_its_start(made, tmp_path):
    from alphallama.train.__main__ import main as train_main
    start_main, start_side = made
    src = tmp_path / "src"
    src.mkdir()
    for f in sorted(STDLIB.glob("*.py"))[:40]:
        if f.stat().st_size < 40_000:
            (src / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "out"
    # the shape flags differ from the start's on purpose: the start's shape wins
    args = ["run", "--out", str(out), "--work-dir", str(tmp_path / "work"), "--root", f"lib={src}", "--corpus-mb", "1",
            "--instruct-examples", "8", "--vocab-size", "999", "--d-model", "64", "--batch-size", "2",
            "--max-steps", "1", "--workers", "1", "--warmup-steps", "1", "--lr", "0", "--split-mib", "0",
            "--init-from", str(start_main), "--commit", "abc"]
    assert train_main(args) == 0
    new, old = GGUFFile(str(out / "alphallama-embedded.gguf")), GGUFFile(str(start_main))
    assert set(new.tensors) == set(old.tensors)
    for name, t in old.tensors.items():                        # Q8_0 of Q8_0-rounded weights: the same blocks
        assert t.qtype == new.tensors[name].qtype and np.array_equal(
            np.asarray(t.data).view(np.uint8), np.asarray(new.tensors[name].data).view(np.uint8)), name
    for k in TOKENIZER_KEYS:
        assert list(np.atleast_1d(new.metadata[k])) == list(np.atleast_1d(old.metadata[k])), k
    assert new.metadata["alphallama.training.init_from_sha256"] == read_start(start_main).sha256
    new_side, old_side = GGUFFile(str(out / "alphallama-embedded.mtp.gguf")), GGUFFile(str(start_side))
    for name, t in old_side.tensors.items():
        assert np.array_equal(np.asarray(t.data).view(np.uint8), np.asarray(new_side.tensors[name].data).view(np.uint8))


def test_a_file_without_its_sidecar_is_refused(made, tmp_path, capsys):
    from alphallama.train.__main__ import main as train_main
    lone = tmp_path / "lone.gguf"
    lone.write_bytes(made[0].read_bytes())
    with pytest.raises(ValueError, match="no dense MTP sidecar"):
        read_start(lone)
    assert train_main(["run", "--out", str(tmp_path / "o"), "--work-dir", str(tmp_path / "w"),
                       "--init-from", str(tmp_path / "missing.gguf")]) == 2
    assert "missing.gguf" in capsys.readouterr().err
