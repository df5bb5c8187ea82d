"""The synthetic-model writer, and the float64 reference forward it is checked with.

The reference (tests/reference_f64.py) is itself checked against llama.cpp's recorded
log-probabilities for stories260K (and, marked slow, Qwen2.5-Coder-0.5B)."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, LlamaFileType
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from alphallama.gguf import writer
from alphallama.gguf.arch import load_config
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, SyntheticSpec, plan_tensors, tensor_data, write_synthetic
from conftest import REFERENCE, SPM_VOCAB, STORIES, VOCAB
from reference_f64 import ReferenceModel, log_softmax

TINY = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3moe")
MIXES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M")
TOKENS = [5, 300, 17, 17, 42, 511, 256, 9]


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is not present")
    return path


def _written(tmp_path, spec: SyntheticSpec, name="m.gguf") -> GGUFFile:
    path = tmp_path / name
    write_synthetic(spec, path)
    return GGUFFile(path)


def _assert_sane(logits: np.ndarray, layer_rms: list[float]) -> None:
    """Finite logits of a useful spread, different per position; a residual stream
    that neither vanishes nor explodes with depth."""
    assert np.isfinite(logits).all()
    spread = logits.std(axis=-1)  # [T]
    assert (spread > 0.2).all() and (spread < 20).all(), spread
    assert np.abs(logits[1:] - logits[:-1]).max() > 1e-3
    assert all(0.3 < r < 30 for r in layer_rms), layer_rms


def plan_of(spec) -> dict:
    return {t.name: t for t in plan_tensors(spec, spec.vocab_size)}


def _types(spec, group):
    return [t.qtype for t in plan_tensors(spec, spec.vocab_size) if t.name.endswith(f".{group}.weight")]


# --- written files: load, round-trip, run -----------------------------------------

@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("preset", TINY)
def test_roundtrip_and_reference_forward(tmp_path, preset, mix):
    spec = PRESETS[preset](quant=mix, seed=3)
    f = _written(tmp_path, spec)
    cfg = load_config(f)
    assert cfg == writer.model_config(spec, spec.vocab_size)

    # tensors: exactly the plan, and the bytes we generated are the bytes the reader maps
    plan = plan_tensors(spec, spec.vocab_size)
    assert list(f.tensors) == [t.name for t in plan]
    for t in plan:
        got = f.tensors[t.name]
        assert (got.qtype, got.shape) == (t.qtype, t.shape), t.name
        assert np.array_equal(np.asarray(got.data).view(np.uint8).reshape(-1), tensor_data(spec, t)), t.name
    # norms, biases and the router stay F32 whatever the mix
    assert all(t.qtype == T.F32 for t in plan if len(t.shape) == 1 or "ffn_gate_inp" in t.name)
    assert plan_of(spec)["blk.0.attn_q.weight"].qtype == T["Q4_K" if mix == "Q4_K_M" else mix]

    logits, layer_rms = ReferenceModel(f).forward(TOKENS)
    assert logits.shape == (len(TOKENS), spec.vocab_size)
    _assert_sane(logits, layer_rms)


def test_metadata_keys_as_llama_cpp_writes_them(tmp_path):
    spec = PRESETS["tiny-qwen3moe"](quant="Q4_K_M")
    md = _written(tmp_path, spec).metadata
    a = "qwen3moe"
    expected = {
        "general.architecture": a, "general.name": "tiny-qwen3moe", "general.type": "model",
        f"{a}.block_count": 2, f"{a}.context_length": 2048, f"{a}.embedding_length": 256,
        f"{a}.feed_forward_length": 512, f"{a}.attention.head_count": 4,
        f"{a}.attention.head_count_kv": 2, f"{a}.attention.key_length": 64,
        f"{a}.attention.value_length": 64, f"{a}.rope.freq_base": 1e6,
        f"{a}.attention.layer_norm_rms_epsilon": float(np.float32(1e-6)),
        f"{a}.expert_count": 8, f"{a}.expert_used_count": 2, f"{a}.expert_feed_forward_length": 256,
        "general.file_type": int(LlamaFileType.MOSTLY_Q4_K_M), "general.quantization_version": 2,
    }
    assert {k: md[k] for k in expected} == expected
    assert f"{a}.rope.dimension_count" not in md   # llama only, as convert_hf_to_gguf does
    llama = _written(tmp_path, PRESETS["tiny-llama"](quant="F16"), "l.gguf").metadata
    assert llama["llama.rope.dimension_count"] == 64 and llama["llama.vocab_size"] == 512
    assert llama["general.file_type"] == LlamaFileType.MOSTLY_F16


def test_weight_scale_follows_fan_in():
    """Every type, once dequantized, has RMS ~ 1/sqrt(fan_in); norms are ~1."""
    base = PRESETS["tiny-llama"](d_ff=1024)
    for qtype in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K):
        spec = writer.with_quant(base, qtype)
        for t in plan_tensors(spec, spec.vocab_size):
            if t.name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight"):
                w = gguf_dequantize(tensor_data(spec, t).reshape(t.shape[0], -1), t.qtype)  # [out, in]
                rms = float(np.sqrt(np.mean(w.astype(np.float64) ** 2)))
                assert abs(rms * math.sqrt(t.shape[-1]) - 1) < 0.1, (qtype.name, t.name, rms)
                # Q4_0's d * (q - 8) over uniform q leans by half a step: mean -0.11 rms
                assert abs(w.mean()) < 0.15 * rms
            if t.name == "blk.0.attn_norm.weight":
                w = tensor_data(spec, t).view(np.float32)
                assert abs(w.mean() - 1) < 0.01 and 0.005 < w.std() < 0.05


def test_deep_model_stays_sane(tmp_path):
    for preset, mix in (("tiny-qwen3", "Q4_K_M"), ("tiny-llama", "Q8_0")):
        spec = PRESETS[preset](n_layers=24, quant=mix, d_ff=256)
        logits, layer_rms = ReferenceModel(_written(tmp_path, spec, preset + ".gguf")).forward(TOKENS)
        _assert_sane(logits, layer_rms)
        assert layer_rms[-1] / layer_rms[0] < 10, layer_rms


# --- quant mixes --------------------------------------------------------------------



def test_q4_k_m_mix_of_qwen3_8b():
    """llama.cpp's Q4_K_M over 36 layers: Q6_K attn_v and ffn_down in the first and last
    eighth (layers 0-3, 31-35) and in every third layer from 6 to 30."""
    spec = PRESETS["qwen3-8b"]()
    more = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 31, 32, 33, 34, 35}
    want = [T.Q6_K if i in more else T.Q4_K for i in range(36)]
    assert _types(spec, "attn_v") == want and _types(spec, "ffn_down") == want
    for g in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
        assert set(_types(spec, g)) == {T.Q4_K}
    plan = plan_of(spec)
    assert plan["token_embd.weight"].qtype == T.Q4_K and plan["output.weight"].qtype == T.Q6_K
    assert plan["blk.0.attn_q_norm.weight"].shape == (128,)
    assert 4.5e9 < sum(t.nbytes for t in plan.values()) < 5.2e9   # real Qwen3-8B-Q4_K_M: 5.03 GB


def test_q4_k_m_mix_of_qwen3_30b_a3b():
    spec = PRESETS["qwen3-30b-a3b"]()
    plan = plan_of(spec)
    assert plan["blk.5.ffn_gate_exps.weight"].shape == (128, 768, 2048)
    assert plan["blk.5.ffn_down_exps.weight"].shape == (128, 2048, 768)
    assert plan["blk.5.ffn_gate_inp.weight"].qtype == T.F32
    downs = _types(spec, "ffn_down_exps")
    assert downs[:6] == [T.Q6_K] * 6 and downs[6:9] == [T.Q4_K, T.Q4_K, T.Q6_K]   # 48 // 8 = 6
    assert set(_types(spec, "ffn_up_exps")) == {T.Q4_K}
    assert 17.5e9 < sum(t.nbytes for t in plan.values()) < 19e9   # real Qwen3-30B-A3B-Q4_K_M: 18.6 GB
    # --layers rebuilds the mix for the new depth
    assert _types(PRESETS["qwen3-30b-a3b"](n_layers=8), "ffn_down_exps") == [T.Q6_K, T.Q4_K, T.Q4_K, T.Q6_K,
                                                                             T.Q4_K, T.Q4_K, T.Q6_K, T.Q6_K]


def test_q4_k_m_mix_of_eight_experts():
    """llama.cpp special-cases exactly 8 experts. (This mix, the dense ones above and a
    16-expert one were checked tensor by tensor against llama.cpp's own quantizer.)"""
    spec = PRESETS["tiny-qwen3moe"](n_layers=16, quant="Q4_K_M")
    assert set(_types(spec, "attn_k")) == set(_types(spec, "attn_v")) == {T.Q8_0}
    assert set(_types(spec, "attn_output")) == {T.Q5_K}
    assert _types(spec, "ffn_down_exps")[:3] == [T.Q6_K, T.Q6_K, T.Q4_K]
    assert set(_types(PRESETS["tiny-qwen3moe"](n_experts=16, quant="Q4_K_M"), "attn_k")) == {T.Q4_K}


def test_tied_embeddings_get_the_output_type():
    spec = PRESETS["tiny-qwen3"](quant="Q4_K_M")
    plan = plan_of(spec)
    assert "output.weight" not in plan and plan["token_embd.weight"].qtype == T.Q6_K


def test_rows_the_block_does_not_divide_fall_back_like_llama_cpp(tmp_path):
    spec = PRESETS["tiny-llama"](d_model=96, n_heads=3, n_kv_heads=1, head_dim=32, d_ff=160, quant="Q4_K")
    types = {n: t.qtype for n, t in plan_of(spec).items()}
    assert types["blk.0.attn_q.weight"] == T.Q5_0   # row 96: Q4_K -> Q5_0
    assert types["blk.0.ffn_down.weight"] == T.Q5_0   # row 160
    spec6 = writer.with_quant(spec, "Q6_K")
    assert {t.qtype for t in plan_tensors(spec6, 512) if len(t.shape) > 1} == {T.Q8_0}
    odd = writer.with_quant(PRESETS["tiny-llama"](d_model=80, n_heads=2, n_kv_heads=1, head_dim=40, d_ff=144), "Q8_0")
    assert plan_of(odd)["blk.0.attn_q.weight"].qtype == T.F16   # row 80: no 32-block type fits
    load_config(_written(tmp_path, odd))


def test_per_layer_override_and_bad_keys():
    spec = PRESETS["tiny-llama"](quant={"ffn_up": T.Q8_0, "blk.1.ffn_up": T.F16})
    assert _types(spec, "ffn_up") == [T.Q8_0, T.F16]
    with pytest.raises(ValueError, match="attn_norm"):
        plan_tensors(PRESETS["tiny-llama"](quant={"attn_norm": T.Q8_0}), 512)
    with pytest.raises(ValueError, match="unknown quant"):
        PRESETS["tiny-llama"](quant="Q4_K_XL")


# --- vocabulary, determinism, CLI ----------------------------------------------------

def test_byte_vocab_without_a_source(tmp_path):
    spec = PRESETS["tiny-qwen3"](vocab_size=300)
    f = _written(tmp_path, spec)
    md = f.metadata
    tokens = md["tokenizer.ggml.tokens"]
    assert len(tokens) == 300 == load_config(f).vocab_size
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.merges"] == ["Ġ Ġ"]
    assert tokens[ord("a")] == "a" and tokens[ord(" ")] == "Ġ" and tokens[257] == "<|endoftext|>"
    assert len(set(tokens)) == 300 and tokens[-1] == "[PAD299]"
    assert md["tokenizer.ggml.eos_token_id"] == 257 and md["tokenizer.ggml.token_type"][257] == 3
    with pytest.raises(ValueError, match="at least"):
        writer.byte_vocab(100)


def test_vocab_copied_from_a_gguf_keeps_keys_values_and_types(tmp_path):
    src = _need(SPM_VOCAB)
    spec = PRESETS["tiny-llama"](vocab_from=str(src), d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, d_ff=128)
    path = tmp_path / "spm.gguf"
    write_synthetic(spec, path)
    theirs, ours = GGUFReader(src), GGUFReader(path)
    keys = [k for k in theirs.fields if k.startswith("tokenizer.")]
    assert keys and keys == [k for k in ours.fields if k.startswith("tokenizer.")]
    for k in keys:
        assert theirs.fields[k].types == ours.fields[k].types, k
        assert theirs.fields[k].contents() == ours.fields[k].contents(), k
    assert load_config(GGUFFile(path)).vocab_size == 32000


@pytest.mark.shared
def test_qwen2_vocab_sets_the_vocab_size(tmp_path):
    src = _need(VOCAB / "ggml-vocab-qwen2.gguf")
    spec = PRESETS["tiny-qwen3"](vocab_from=str(src), d_model=64, n_heads=2, n_kv_heads=1, head_dim=32,
                                 d_ff=128, n_layers=1, quant="Q8_0")
    f = _written(tmp_path, spec)
    source = GGUFFile(src).metadata
    assert {k: v for k, v in f.metadata.items() if k.startswith("tokenizer.")} == \
        {k: v for k, v in source.items() if k.startswith("tokenizer.")}
    assert load_config(f).vocab_size == 151936 == f.tensors["token_embd.weight"].shape[0]
    assert np.isfinite(ReferenceModel(f).logits([151643, 9707, 11])).all()


def test_same_seed_same_file(tmp_path):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    write_synthetic(PRESETS["tiny-qwen3moe"](quant="Q4_K_M", seed=7), a)
    write_synthetic(PRESETS["tiny-qwen3moe"](quant="Q4_K_M", seed=7), b)
    write_synthetic(PRESETS["tiny-qwen3moe"](quant="Q4_K_M", seed=8), c)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    # a tensor's values depend on (seed, name) only, not on the layers around it
    one, two = PRESETS["tiny-llama"](n_layers=1), PRESETS["tiny-llama"](n_layers=3)
    t0 = next(t for t in plan_tensors(one, 512) if t.name == "blk.0.ffn_up.weight")
    assert np.array_equal(tensor_data(one, t0), tensor_data(two, t0))


def test_interrupted_write_leaves_no_file(tmp_path):
    def stop(t):
        if t.name == "blk.0.ffn_up.weight":
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        write_synthetic(PRESETS["tiny-llama"](), tmp_path / "m.gguf", progress=stop)
    assert list(tmp_path.iterdir()) == []


def test_cli_hook(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    writer.add_arguments(parser)
    out = tmp_path / "cli.gguf"
    args = parser.parse_args(["--preset", "tiny-qwen3moe", "-o", str(out), "--layers", "3", "--quant", "q8_0",
                              "--seed", "2"])
    assert writer.run(args) == 0
    assert "wrote" in capsys.readouterr().out
    cfg = load_config(GGUFFile(out))
    assert cfg.n_layers == 3 and GGUFFile(out).tensors["blk.2.ffn_up_exps.weight"].qtype == T.Q8_0
    bad = parser.parse_args(["--preset", "tiny-llama", "-o", str(out), "--quant", "Q9_Z"])
    assert writer.run(bad) == 2


# --- the reference against llama.cpp -------------------------------------------------

def _errors_against_llama_cpp(model: ReferenceModel, case: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Teacher-force llama.cpp's tokens: (our argmax per generated position, |log-prob
    error| of llama.cpp's top-1 token per position, the same for all its top-5 tokens)."""
    ids = case["prompt_ids"] + case["gen_ids"]
    logp = log_softmax(model.logits(ids))[len(case["prompt_ids"]) - 1:-1]  # [n_gen, vocab]
    top1 = np.array([abs(logp[i, top[0][0]] - top[0][1]) for i, top in enumerate(case["top5"])])
    top5 = np.array([abs(logp[i, t] - lp) for i, top in enumerate(case["top5"]) for t, lp in top])
    return logp.argmax(-1), top1, top5


def test_reference_matches_llama_cpp_on_stories260k():
    """All F32 weights, so the only noise is llama.cpp's: it keeps K and V in fp16 and its
    CPU flash attention accumulates V in fp16, which moves log-probs by ~1e-3 (replaying
    that in numpy cuts the mean error ~3x). The float64 reference and the float32 engine
    agree to ~1e-6."""
    model = ReferenceModel(GGUFFile(_need(STORIES)))
    for case in json.loads(_need(REFERENCE / "stories260K.json").read_text())["cases"]:
        argmax, top1, top5 = _errors_against_llama_cpp(model, case)
        assert list(argmax) == case["gen_ids"], case["input"]
        assert top1.max() < 5e-3 and top1.mean() < 1e-3, (case["input"], top1.max(), top1.mean())
        assert top5.max() < 3e-2, (case["input"], top5.max())


@pytest.mark.slow
@pytest.mark.shared
def test_reference_matches_llama_cpp_on_qwen2(qwen_path):
    """qwen2: NEOX rope, q/k/v biases, tied output head, Q5_0/Q8_0/Q4_K/Q6_K weights.

    llama.cpp's CPU matmuls round the activations to Q8_0/Q8_K before every quantized dot
    product, so here it differs by ~0.05 in log-prob (up to ~0.4 for 5th-ranked tokens);
    the float32 engine and this reference agree to 2e-5. A different greedy token is
    allowed only where llama.cpp's top two are a near tie."""
    model = ReferenceModel(GGUFFile(qwen_path), cache=False)
    cases = json.loads(_need(REFERENCE / "qwen2.5-coder-0.5b-instruct.json").read_text())["cases"]
    case = next(c for c in cases if c["kind"] == "raw")
    argmax, top1, top5 = _errors_against_llama_cpp(model, case)
    for i in np.flatnonzero(argmax != np.array(case["gen_ids"])):
        (t1, lp1), (t2, lp2) = case["top5"][i][:2]
        assert argmax[i] == t2 and lp1 - lp2 < 0.1, (i, case["top5"][i][:2])
    assert top1.max() < 0.2 and top1.mean() < 0.02, (top1.max(), top1.mean())
    assert top5.max() < 0.6 and top5.mean() < 0.1, (top5.max(), top5.mean())


@pytest.mark.parametrize("preset", TINY)
def test_llama_cpp_loads_them_and_agrees_with_the_reference(tmp_path, preset):
    """Where llama-cpp-python is installed: llama.cpp loads every tiny architecture and,
    with all-F32 weights and an F32 KV cache (no fp16 anywhere), its logits equal the
    float64 reference's to float32 rounding. (Measured: 1e-6 in log-prob for all four.)"""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = tmp_path / f"{preset}.gguf"
    write_synthetic(PRESETS[preset](), path)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2,
                          flash_attn=False, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(TOKENS)
    theirs = log_softmax(np.array(llm.scores[:len(TOKENS)], dtype=np.float64))  # [T, vocab]
    ours = log_softmax(ReferenceModel(GGUFFile(path)).logits(TOKENS))  # [T, vocab]
    assert np.abs(ours - theirs).max() < 1e-4


@pytest.mark.parametrize("mix, size, rules", [
    # real Qwen3-8B files (bartowski's, no imatrix in these types' rules): 4.12 / 4.56 / 3.37 GB
    ("Q3_K_M", (4.0e9, 4.25e9), {"attn_q": [T.Q3_K] * 36, "attn_v": [T.Q5_K] * 2 + [T.Q4_K] * 34,
                                 "ffn_down": [T.Q5_K] * 2 + [T.Q4_K] * 34, "attn_output": [T.Q4_K] * 36}),
    ("IQ4_XS", (4.45e9, 4.7e9), {"attn_q": [T.IQ4_XS] * 36, "attn_v": [T.Q5_K] * 36,
                                 "ffn_down": [T.Q5_K] * 4 + [T.IQ4_XS] * 32}),
    ("IQ3_XXS", (3.3e9, 3.6e9), {"attn_q": [T.IQ2_S] * 36, "attn_k": [T.IQ2_S] * 36, "attn_v": [T.Q4_K] * 36,
                                 "ffn_down": [T.Q4_K] * 4 + [T.Q3_K] * 32, "attn_output": [T.IQ3_S] * 36,
                                 "ffn_up": [T.IQ3_XXS] * 36}),
])
def test_llama_cpp_mixes_of_qwen3_8b(mix, size, rules):
    """llama-quantize's Q3_K_M / IQ4_XS / IQ3_XXS rules (llama_tensor_get_type) on Qwen3-8B's 36
    layers (4 query heads a key head): the per-layer types and the file's size."""
    spec = PRESETS["qwen3-8b"](quant=mix)
    for g, want in rules.items():
        assert _types(spec, g) == want, g
    plan = plan_of(spec)
    head = {"Q3_K_M": (T.Q6_K, T.Q3_K), "IQ4_XS": (T.Q6_K, T.IQ4_XS), "IQ3_XXS": (T.Q5_K, T.IQ3_S)}[mix]
    assert (plan["output.weight"].qtype, plan["token_embd.weight"].qtype) == head
    assert size[0] < sum(t.nbytes for t in plan.values()) < size[1]
