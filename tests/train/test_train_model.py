"""The training model against the GGUF it exports (loaded by our reader and reference
model), a training step that lowers the loss, and a whole tiny pipeline run."""
from __future__ import annotations

import gzip
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from alphallama.gguf.arch import expected_tensors, load_config
from alphallama.gguf.reader import GGUFFile
from alphallama.model.loader import load_model
from alphallama.train.bpe import gguf_tokenizer_kv, train_bpe
from alphallama.train.export import FILE_TYPES, export
from alphallama.train.instruct import chat_template_text
from alphallama.train.loop import losses
from alphallama.train.model import MoEConfig, MoEModel
from alphallama.train.mtp import MTPConfig, MTPHead
from alphallama.train.parts import join_parts, sha256_file, split_file

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CFG = MoEConfig(vocab_size=600, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                n_experts=4, n_experts_used=2, d_ff_expert=64, ctx_len=64)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok_kv():
    texts = [(STDLIB / f).read_text() for f in ("textwrap.py", "shlex.py", "glob.py")]
    hf = train_bpe(texts, CFG.vocab_size)
    return hf, gguf_tokenizer_kv(hf, chat_template_text())


def _model(seed=0):
    torch.manual_seed(seed)
    m = MoEModel(CFG, std=0.1)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return m, MTPHead(MTPConfig.from_model(CFG.model_config(), 96))


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0, QT.Q5_1, QT.Q5_0])
def test_export_loads_and_matches_the_training_model(tmp_path, tok_kv, qtype):
    hf, kv = tok_kv
    model, head = _model()
    main, side = export(tmp_path, "m", model, head, kv, {"alphallama.training.steps": 3}, qtype)
    f = GGUFFile(str(main))
    cfg = load_config(f)
    assert cfg == CFG.model_config()
    assert f.metadata["general.file_type"] == int(FILE_TYPES[qtype])
    assert {f.tensors[n].qtype for n in f.tensors if n.endswith("attn_q.weight")} == {qtype}
    assert set(f.tensors) == set(expected_tensors(cfg))          # only what llama.cpp loads
    assert f.metadata["alphallama.training.steps"] == 3
    ref = load_model(f, 64)
    ids = hf.encode((STDLIB / "glob.py").read_text()[:400]).ids[:40]
    want, _ = ref.forward(torch.tensor(ids), 0, ref.new_cache(64))  # [T, V]
    with torch.no_grad():
        if qtype != QT.F32:   # the training model with the weights as stored (Q8_0-rounded)
            for name, p in model.gguf_params().items():
                p.copy_(ref.w[name])
        hidden, _ = model(torch.tensor([ids]))
        got = model.logits(hidden)[0]
    assert (got - want).abs().max().item() < 1e-4
    assert side.name == "m.mtp.gguf" and GGUFFile(str(side)).metadata["qwen3moe.block_count"] == CFG.n_layers + 1


@pytest.mark.parametrize("chunk, frac", [(0, 1.0), (16, 0.25)])   # plain; the chunked CE and MTP subset
def test_a_few_steps_lower_the_loss(tok_kv, chunk, frac):
    model, head = _model()
    opt = torch.optim.AdamW([p for m in (model, head) for p in m.parameters()], lr=3e-3)
    x = torch.randint(0, CFG.vocab_size, (4, 33))
    first = None
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        main, mtp, aux, _, _ = losses(model, head, x, 3, "cpu", chunk=chunk, mtp_frac=frac, generator=g)
        loss = main + 0.3 * sum(mtp) / 3 + 0.01 * aux
        first = first if first is not None else (main.item(), [m.item() for m in mtp])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert main.item() < first[0] - 0.5
    assert all(a < b - 0.3 for a, b in zip([m.item() for m in mtp], first[1]))


@pytest.mark.parametrize("size, sizes", [(10_000, [4096, 4096, 1808]), (8192, [4096, 4096]), (0, [0])])
def test_split_and_join(tmp_path, size, sizes):
    import hashlib
    p = tmp_path / "f.bin"
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    p.write_bytes(data)
    out = tmp_path / "parts"
    out.mkdir()
    sums = split_file(p, out, 4096)
    parts = sorted(out.glob("f.bin.part*"))
    assert [q.name for q in parts] == [f"f.bin.part{i:02d}" for i in range(len(sizes))]
    assert [q.stat().st_size for q in parts] == sizes
    lines = [line.split() for line in sums.read_text().splitlines()]
    assert lines == [[hashlib.sha256(q.read_bytes()).hexdigest(), q.name] for q in parts] \
        + [[hashlib.sha256(data).hexdigest(), "f.bin"]]
    assert join_parts(sums, tmp_path / "g.bin") == sha256_file(p)
    assert (tmp_path / "g.bin").read_bytes() == data


def test_join_refuses_damage(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(256)) * 40)
    sums = split_file(p, tmp_path, 4096)
    lines = sums.read_text().splitlines()
    sums.write_text("\n".join(lines[:-1] + ["0" * 64 + "  f.bin"]) + "\n")   # parts fine, whole wrong
    with pytest.raises(ValueError, match="joined file's sha256"):
        join_parts(sums, tmp_path / "g.bin")
    assert not (tmp_path / "g.bin").exists() and not (tmp_path / "g.bin.partial").exists()
    sums.write_text("\n".join(lines) + "\n")
    (tmp_path / "f.bin.part01").unlink()
    with pytest.raises(ValueError, match="part01: missing part"):
        join_parts(sums, tmp_path / "g.bin")
    sums.write_text("not a checksum line\n")
    with pytest.raises(ValueError, match="expected `<sha256>  <file name>`"):
        join_parts(sums, tmp_path / "g.bin")


def test_tiny_pipeline_run(tmp_path):
    from alphallama.train.__main__ import main
    src = tmp_path / "src"
    src.mkdir()
    for f in sorted(STDLIB.glob("*.py"))[:60]:
        if f.stat().st_size < 40_000:
            (src / f.name).write_bytes(f.read_bytes())
    out, work = tmp_path / "out", tmp_path / "work"
    args = ["run", "--out", str(out), "--work-dir", str(work), "--root", f"lib={src}", "--corpus-mb", "1",
            "--tokenizer-sample-mb", "1", "--instruct-examples", "16", "--vocab-size", "400", "--ctx", "32",
            "--d-model", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
            "--experts", "2", "--experts-used", "1", "--expert-ffn", "32", "--mtp-ffn", "32", "--batch-size", "2",
            "--max-steps", "3", "--workers", "1", "--warmup-steps", "1", "--quant", "F32", "--commit", "abc",
            "--split-mib", "0.01"]   # parts of 10 KiB: both GGUFs come out split
    assert main(args) == 0
    report = json.loads((out / "train.json").read_text())
    assert report["state"]["step"] == 3 and report["curves"]["val"]
    names = {p.name for p in out.iterdir()}
    joined = {}
    for stem in ("alphallama-embedded.gguf", "alphallama-embedded.mtp.gguf"):
        assert stem not in names and f"{stem}.part00" in names and f"{stem}.part01" in names
        joined[stem] = tmp_path / stem
        assert main(["join", str(out / f"{stem}.sha256"), "-o", str(joined[stem])]) == 0
        assert sha256_file(joined[stem]) == report["files"][stem]
    md = GGUFFile(str(joined["alphallama-embedded.gguf"])).metadata
    assert md["alphallama.training.corpus_manifest_sha256"] == sha256_file(out / "manifest.tsv.gz")
    assert md["alphallama.training.steps"] == 3 and md["alphallama.training.commit"] == "abc"
    assert GGUFFile(str(joined["alphallama-embedded.mtp.gguf"])).metadata["alphallama.training.commit"] == "abc"
    assert main(["join", str(out / "missing.sha256"), "-o", str(tmp_path / "x")]) == 2   # a clear error
    # held-out files never reach the training stream
    d = torch.load(work / "data.pt", weights_only=True)   # plain tensors and values (pipeline.save_data_cache)
    from tokenizers import Tokenizer as HF
    hf = HF.from_str(d["tokenizer"])
    stream = d["train"].numpy().tobytes()
    with gzip.open(out / "heldout.jsonl.gz", "rt") as fh:
        held = [json.loads(line)["text"] for line in fh]
    for text in held:
        probe = np.asarray(hf.encode(text).ids[:24], dtype=np.uint16).tobytes()
        assert probe not in stream
    assert main(args[:-2] + ["--max-steps", "5"]) == 0          # a second call resumes
    assert json.loads((out / "train.json").read_text())["state"]["step"] == 5


def test_export_refuses_a_type_it_cannot_write(tmp_path, tok_kv):
    model, head = _model()
    with pytest.raises(ValueError, match="Q4_K"):
        export(tmp_path, "m", model, head, tok_kv[1], {}, QT.Q4_K)


def test_inspect_shows_provenance(tmp_path, tok_kv):
    from alphallama.cli_inspect import describe
    _, kv = tok_kv
    model, head = _model()
    meta = {"alphallama.training.command": "python -m alphallama.train run --out X",
            "alphallama.training.date": "2026-11-29T00:00:00+00:00",
            "alphallama.training.corpus_manifest_sha256": "ab" * 32, "alphallama.training.steps": 9}
    main, _ = export(tmp_path, "m", model, head, kv, meta, QT.F32)
    d = describe(str(main))
    assert d["provenance"] == {k.rsplit(".", 1)[1]: v for k, v in meta.items()}


def test_schedule_spans_the_calls_that_will_train():
    """One call: the cosine ends at its deadline (or the budget, whichever comes first). A
    call that a later one continues (--continue-later): it spans the whole budget, so the
    two calls make one schedule and the first leaves the rate where the budget says."""
    from alphallama.train.loop import Hyper, State, lr_at, schedule_budget
    hp = Hyper(batch_size=1, ctx_len=8, lr=1e-3, warmup_steps=0, time_budget_s=900.0, mtp_depths=1, mtp_weight=0.3,
               aux_weight=0.01)
    st = State()
    assert schedule_budget(hp, st, None, 0.0, False) == 900.0
    assert schedule_budget(hp, st, 500.0, 0.0, False) == pytest.approx(475.0)   # this call's 95%
    assert schedule_budget(hp, st, 500.0, 0.0, True) == 900.0
    st.step, st.trained_s = 10, 450.0                                         # the first call's end
    first = lr_at(hp, st, schedule_budget(hp, st, 500.0, 0.0, True))
    assert first == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 0.5))))   # mid-schedule
    assert lr_at(hp, st, schedule_budget(hp, st, 10_000.0, 0.0, False)) == first   # the second call resumes it
