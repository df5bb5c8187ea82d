"""MTP distillation (train/distill_*.py): the batched teacher against the reference
model, the loss targets, the drafter-terms evaluation, and a tiny end-to-end run whose
sidecar our reader loads with the docs/MTP.md names and shapes."""
from __future__ import annotations

import json
import math
import random
import textwrap

import pytest
import torch

from alphallama.gguf.arch import load_config
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.model.loader import load_model
from alphallama.train import distill_mtp
from alphallama.train.distill_eval import _rounds
from alphallama.train.distill_generate import generate_batch
from alphallama.train.distill_init import init_from_teacher
from alphallama.train.distill_loss import distill_kl
from alphallama.train.parts import join_parts, split_file
from alphallama.train.distill_requests import KINDS, functions_of
from alphallama.train.distill_teacher import Teacher
from alphallama.train.mtp import MTPConfig, MTPHead


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("distill") / "tiny-qwen2.gguf"
    write_synthetic(PRESETS["tiny-qwen2"](quant="Q8_0"), path)
    return path


def test_teacher_matches_reference_model(tiny):
    ref = load_model(GGUFFile(tiny), 64)
    teacher = Teacher.from_gguf(tiny, "cpu", torch.float32, 64)
    toks = torch.randint(0, 512, (3, 17), generator=torch.Generator().manual_seed(0))
    h = teacher.forward(toks)                                                  # [3, 17, D]
    for b in range(3):
        logits, hidden = ref.forward(toks[b], 0, ref.new_cache())
        torch.testing.assert_close(h[b], hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(teacher.logits(h[b]), logits, atol=1e-4, rtol=1e-4)
    # the cached, left-padded path (generation) gives each row what a plain pass gives
    cache = teacher.new_cache(3, 24)
    cache.valid[:] = True
    cache.valid[1, :4] = False                                                 # row 1: 4 padding slots
    hc = torch.cat([teacher.forward(toks[:, :9], cache, 0), teacher.forward(toks[:, 9:], cache, 9)], 1)
    torch.testing.assert_close(hc[[0, 2]], h[[0, 2]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hc[1, 4:], teacher.forward(toks[1:2, 4:])[0], atol=1e-5, rtol=1e-5)


def test_batched_greedy_generation_equals_reference_decoding(tiny):
    ref = load_model(GGUFFile(tiny), 64)
    teacher = Teacher.from_gguf(tiny, "cpu", torch.float32, 64)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (6, 2, 9)]
    stops = [5, 300]
    for prompt, got in zip(prompts, generate_batch(teacher, prompts, 12, stops, prefill_chunk=4)):
        cache, want = ref.new_cache(), []
        logits, _ = ref.forward(torch.tensor(prompt), 0, cache)
        for i in range(12):
            want.append(int(logits[-1].argmax()))
            if want[-1] in stops:
                break
            logits, _ = ref.forward(torch.tensor(want[-1:]), len(prompt) + i, cache)
        assert got == want


@pytest.mark.slow
@pytest.mark.shared
def test_teacher_matches_reference_on_qwen(qwen_path):
    # the real model's first 4 layers (its biases, scales and quant types) keep this cheap
    from dataclasses import replace

    from alphallama.gguf.arch import expected_tensors
    from alphallama.gguf.quants import dequantize
    from alphallama.model.transformer import Transformer
    from alphallama.tokenizer import Tokenizer
    f = GGUFFile(qwen_path)
    cfg = replace(load_config(f), n_layers=4)
    weights = {n: dequantize(f.tensors[n].data, f.tensors[n].qtype, f.tensors[n].shape)
               for n in expected_tensors(cfg)}                                # float32, shared by both
    toks = torch.tensor([Tokenizer.from_metadata(f.metadata).encode("def fibonacci(n):\n    return n")])
    ref = Transformer(cfg, weights, 16)
    logits, hidden = ref.forward(toks[0], 0, ref.new_cache())
    teacher = Teacher(cfg, weights, 16)
    h = teacher.forward(toks)[0]
    assert (h - hidden).abs().max() < 1e-4 * hidden.abs().max()
    assert (teacher.logits(h) - logits).abs().max() < 1e-3


def test_kl_loss_hand_checked():
    # V = D = 3 and an identity head: the head inputs are the logits themselves.
    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]], dtype=torch.float64)
    teacher_in = p.log()                                                      # [N=2, D]
    student = torch.zeros(1, 2, 3, dtype=torch.float64, requires_grad=True)   # uniform q
    valid = torch.tensor([[True, True]])
    loss, st = distill_kl(student, teacher_in, torch.eye(3, dtype=torch.float64), valid)
    want = [sum(pi * math.log(pi / (1 / 3)) for pi in row) for row in p.tolist()]
    assert st.kl[0].tolist() == pytest.approx(want, abs=1e-6)
    assert float(loss.detach()) == pytest.approx(sum(want) / 2, abs=1e-6)
    assert st.teacher_top.tolist() == [0, 2]
    assert st.student_p[0].tolist() == pytest.approx([1 / 3, 1 / 3])
    loss.backward()
    # d mean-KL / d logits = (q - p) / N
    torch.testing.assert_close(student.grad[0], (1 / 3 - p) / 2, atol=1e-6, rtol=0)


def test_targets_are_the_teacher_distribution_at_the_predicted_position(tiny):
    teacher = Teacher.from_gguf(tiny, "cpu", torch.float32, 64)
    toks = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(2))
    h = teacher.forward(toks)                                                  # [2, 12, D]
    t_in = teacher.normed(h)                                                   # the teacher's head inputs
    K = 3
    # the depth-k entry at p predicts x_{p+1}: a student equal to the teacher at p is exact
    loss, st, valid = distill_mtp.step_loss(teacher, [t_in.clone() for _ in range(K)], h, 64)
    assert float(loss) == pytest.approx(0.0, abs=1e-5)
    assert bool(st.agree[valid].all())
    assert valid.view(K, 2, 12).sum((1, 2)).tolist() == [2 * (12 - k) for k in range(1, K + 1)]
    # a student aligned with the hidden state it starts from (p - k) is not
    shifted = [torch.roll(t_in, k, dims=1) for k in range(1, K + 1)]
    loss, st, valid = distill_mtp.step_loss(teacher, shifted, h, 64)
    assert float(loss) > 0.1
    # and each entry's loss is the KL to softmax(teacher logits at p), computed directly
    for k in range(K):
        for b, p in [(0, 5), (1, 11)]:
            pt = teacher.logits(h[b, p]).log_softmax(-1)
            qs = torch.nn.functional.linear(shifted[k][b, p], teacher.output).log_softmax(-1)
            want = float((pt.exp() * (pt - qs)).sum())
            assert float(st.kl[k, b * 12 + p]) == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_chain_survival_counts_drafts_of_one_round():
    # agree[k, b, p]: the depth-(k+1) entry at p is right. A round starting at n uses
    # the depth-1 entry at n, depth-2 at n+1, depth-3 at n+2.
    T, K = 8, 3
    agree = torch.zeros(K, 1, T, dtype=torch.bool)
    agree[0, 0, [1, 2, 3, 4]] = True
    agree[1, 0, [2, 5]] = True          # round n=1: d1@1, d2@2 right; round n=4: d1@4, d2@5 right
    agree[2, 0, [3]] = True             # round n=1: d3@3 right too
    ok = torch.ones_like(agree)
    surv, prop = _rounds(agree, ok, K)  # rounds n = 1..T-K
    assert surv[0, 0].tolist() == [True, True, True, True, False]
    assert surv[1, 0].tolist() == [True, False, False, True, False]
    assert surv[2, 0].tolist() == [True, False, False, False, False]
    ok[1, 0, 2] = False                 # round 1's draft 2 under min-p: drafting stops there
    _, prop = _rounds(agree, ok, K)
    assert prop[:, 0, 0].tolist() == [True, False, False]


def test_parts_round_trip_and_damage(tmp_path):
    src = tmp_path / "x.gguf"
    src.write_bytes(bytes(random.Random(0).randbytes(2500)))
    out = tmp_path / "out"
    out.mkdir()
    sums = split_file(src, out, 1000)
    assert sorted(p.name for p in out.iterdir()) == ["x.gguf.part00", "x.gguf.part01", "x.gguf.part02",
                                                    "x.gguf.sha256"]
    join_parts(sums, tmp_path / "joined")
    assert (tmp_path / "joined").read_bytes() == src.read_bytes()
    (out / "x.gguf.part01").write_bytes(b"\0" * 1000)
    with pytest.raises(ValueError, match="part01: sha256 mismatch"):
        join_parts(sums, tmp_path / "joined2")


SOURCE = textwrap.dedent('''
    import os


    def scale_values(values, factor=2):
        """Multiply every value by a factor and return the new list."""
        out = []
        for v in values:
            out.append(v * factor)
        return out


    def total(values):
        """Return the sum of scale_values applied to the values."""
        scaled = scale_values(values)
        return sum(scaled)
''')


def test_requests_and_rename_answer():
    funcs = functions_of(SOURCE)
    assert [f.name for f in funcs] == ["scale_values", "total"]
    assert funcs[0].signature == "scale_values(values, factor=2)"
    req = KINDS["rename"][0](funcs[0], random.Random(0))
    new = req.user.split("`")[3]
    assert req.answer.count(new) == 3 and "scale_values" not in req.answer.replace(new, "")
    ns: dict = {}
    exec(req.answer.removeprefix("```python\n").removesuffix("\n```"), ns)  # the renamed file runs
    assert ns["total"]([1, 2]) == 6


def test_tiny_run_exports_a_readable_sidecar(tiny, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"mod{i}.py").write_text(SOURCE.replace("scale_values", f"scale_{i}") + f"\nX = {i}\n" * 40)
    out = tmp_path / "out"
    rc = distill_mtp.main([
        "-m", str(tiny), "--out", str(out), "--work-dir", str(tmp_path / "work"), "--corpus-root", str(corpus),
        "--device", "cpu", "--workers", "0", "--seq-len", "64", "--batch-size", "2", "--max-steps", "2",
        "--time-budget-s", "60", "--gen-budget-s", "30", "--max-new", "8", "--requests", "4",
        "--eval-requests", "2", "--eval-code-rows", "2", "--held-out-frac", "0.3", "--log-every", "1",
        "--max-prompt", "1024", "--part-mib", "1", "--eval-every-s", "1e-6"])
    assert rc == 0
    res = json.loads((out / "distill_curves.json").read_text())
    steps = [r for r in res["curve"] if "eval" not in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(len(r["kl"]) == 3 and len(r["top1_agree"]) == 3 for r in steps)
    assert [r["step"] for r in res["curve"] if "eval" in r] == [0, 1, 2]   # one before each step
    assert res["data"]["generated_tokens"] > 0 and set(res["eval_final"]) == {"code", "chat"}
    # teacher-forced on its own greedy answers, the teacher's top-1 is the next token at
    # every counted position: the answer mask is aligned with the generated tokens
    assert res["eval_final"]["chat"]["teacher_top1_is_next_token"] == 1.0
    sidecar = tmp_path / "joined.mtp.gguf"
    join_parts(out / "tiny-qwen2.mtp.gguf.sha256", sidecar)
    f = GGUFFile(sidecar)
    md, L, D, F, Q, KV = f.metadata, 2, 256, 512, 256, 128
    assert md["general.architecture"] == "qwen2" and md["qwen2.nextn_predict_layers"] == 1
    assert md["qwen2.block_count"] == L + 1 and md["qwen2.feed_forward_length"] == F
    assert (md["qwen2.embedding_length"], md["qwen2.attention.head_count"],
            md["qwen2.attention.head_count_kv"], md["qwen2.attention.key_length"]) == (D, 4, 2, 64)
    assert md["alphallama.training.steps"] == 2
    want = {"nextn.enorm.weight": (D,), "nextn.hnorm.weight": (D,), "nextn.eh_proj.weight": (D, 2 * D),
            "nextn.shared_head_norm.weight": (D,), "attn_norm.weight": (D,), "attn_q.weight": (Q, D),
            "attn_k.weight": (KV, D), "attn_v.weight": (KV, D), "attn_output.weight": (D, Q),
            "attn_q.bias": (Q,), "attn_k.bias": (KV,), "attn_v.bias": (KV,), "ffn_norm.weight": (D,),
            "ffn_gate.weight": (F, D), "ffn_up.weight": (F, D), "ffn_down.weight": (D, F)}
    assert {n: t.shape for n, t in f.tensors.items()} == {f"blk.{L}.{n}": s for n, s in want.items()}
    assert f.tensors[f"blk.{L}.attn_q.weight"].qtype.name == "Q8_0"


def test_init_copies_the_last_layer(tiny):
    teacher = Teacher.from_gguf(tiny, "cpu", torch.float32, 64)
    head = MTPHead(MTPConfig.from_model(teacher.cfg, teacher.cfg.d_ff))
    init_from_teacher(head, teacher, 3.0, 0)
    w = teacher.w
    torch.testing.assert_close(head.wq.weight, w["blk.1.attn_q.weight"])
    torch.testing.assert_close(head.wq.bias, w["blk.1.attn_q.bias"])
    torch.testing.assert_close(head.down.weight, w["blk.1.ffn_down.weight"])
    torch.testing.assert_close(head.shared_head_norm.data, w["output_norm.weight"])
    D = teacher.cfg.d_model
    torch.testing.assert_close(head.eh_proj.weight[:, D:], 3.0 * torch.eye(D))


def test_engine_reference_drafts_what_training_computed(tiny, tmp_path):
    """The contract end to end: a head exported by the distillation's writer path, run by
    the engine's reference MTP block (model/mtp.py, draft chains over its own cache),
    drafts the tokens, with the probabilities, that the training forward gives the
    depth-k entries of the sequence continued by those drafts."""
    from gguf import GGMLQuantizationType

    from alphallama.gguf.arch import mtp_head_config
    from alphallama.model.mtp import MTPHead as EngineHead
    from alphallama.train.mtp import shift_right, write_sidecar
    ref = load_model(GGUFFile(tiny), 64)
    teacher = Teacher.from_gguf(tiny, "cpu", torch.float32, 64)
    head = MTPHead(MTPConfig.from_model(teacher.cfg, teacher.cfg.d_ff))
    init_from_teacher(head, teacher, 1.2, 0)
    with torch.no_grad():   # away from the init's structure, as training leaves it
        for prm in head.parameters():
            prm.add_(0.02 * torch.randn(prm.shape, generator=torch.Generator().manual_seed(prm.numel())))
    path = tmp_path / "tiny-qwen2.mtp.gguf"
    write_sidecar(path, head, arch="qwen2", n_layers=2, ctx_len=2048, qtype=GGMLQuantizationType.F32)
    f = GGUFFile(path)
    engine = EngineHead.load(f, mtp_head_config(f, ref.cfg, sidecar=True), ref, 64)
    toks = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(4))
    n, K = 9, 3                                     # the bonus token sits at position n
    h = teacher.forward(toks)                       # [1, 12, D]
    drafts, probs = engine.draft(shift_right(h)[0, :n + 1], toks[0, :n + 1], 0, K, engine.new_cache())
    seq = torch.cat([toks[:, :n + 1], torch.tensor([drafts[:K - 1]])], 1)   # x_0..x_n, d1, d2
    with torch.no_grad():
        states = head(teacher.forward(seq), seq, teacher.embedding, depths=K)
    for k in range(K):                              # draft k+1 = depth-(k+1) entry at n+k
        q = torch.nn.functional.linear(states[k][0, n + k], teacher.output).softmax(-1)
        assert int(q.argmax()) == drafts[k]
        assert float(q.max()) == pytest.approx(probs[k], abs=1e-4)
