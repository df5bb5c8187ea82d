"""gemma3 on the GPU runtime (Triton kernels; the interpreter on CPU): the sqrt(d) embedding
scale, sliding-window attention on the SWA layers with their own rope base, post norms on
both branches, the GeGLU FFN (its kernel: tests/kernels/test_gelu_mul.py) and the final
logit softcap, in a prefill chunk (more than 64 rows: SDPA with the windowed mask) and in a
decode round past the window (the split-KV kernel's window: tests/kernels/test_attention_window.py),
against the reference (model/transformer.py, proven against llama.cpp).

The model: tiny-gemma3 at two layers, the window pattern 2 (layer 0 slides over 16 keys
with rope base 1e4, layer 1 is global with base 1e6), the softcap at 2 (the preset's 30
barely touches random logits of ~4: 0.2 of the tolerance; at 2 it halves them). Each
control is the reference without one piece, which must differ by far more than the GPU
tests' tolerance (4% of the max logit: test_gpu_model.py). The q.k scale is 1/sqrt(64) at
this head size (gemma3's query_pre_attn_scalar is the head dim but in the 27B); a scale of
0.3 is checked in the kernel test and in test_prefill_attention_window here."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch


from alphallama.gguf.arch_variants import gpu_departures
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.model.layers import attention
from alphallama.model.loader import load_model
from alphallama.model.transformer import Transformer
from alphallama.runtime.gpu_model import GPUModel
from alphallama.runtime.gpu_prefill import prefill_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CTX = 128
PROMPT, ROUND = 70, 3            # a prefill chunk of 70 rows, then a decode round at 70..72
MD = {"attention.sliding_window": 16, "final_logit_softcapping": 2.0, "attention.sliding_window_pattern": 2}
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(reference, GPU model, tokens, reference logits, GPU logits of the chunk and the round, the cache)."""
    path = tmp_path_factory.mktemp("gemma3") / "gemma3.gguf"
    write_synthetic(PRESETS["tiny-gemma3"](n_layers=2, quant="Q8_0", seed=3, extra_md=MD), path)
    f = GGUFFile(path)
    ref, gpu = load_model(f, CTX), GPUModel(f, CTX, device=DEV)
    assert gpu_departures(ref.cfg) == []
    assert gpu.windows == (16, 0) and gpu.ropes[0] is not gpu.ropes[1] and gpu.softcap == 2.0
    toks = torch.randint(0, ref.cfg.vocab_size, (PROMPT + ROUND,), generator=torch.Generator().manual_seed(0))
    lr, _ = ref.forward(toks, 0, ref.new_cache(CTX))                                # [73, V]
    cache = gpu.new_cache(CTX)
    chunk = gpu.forward(toks[:PROMPT], 0, cache)[0].clone()                         # the prefill path
    rnd = gpu.forward(toks[PROMPT:], PROMPT, cache)[0].clone()                      # one decode round of 3
    return ref, gpu, toks, lr, torch.cat([chunk, rnd]).cpu(), cache


def _without(ref, toks, **change) -> torch.Tensor:
    v = ref.cfg.variant
    t = Transformer(replace(ref.cfg, variant=replace(v, **change)), ref.w, ref.max_len)
    return t.forward(toks, 0, t.new_cache(CTX))[0]


def test_chunk_and_round_follow_the_reference(run):
    """The prefill chunk's rows and the decode round's (positions 70..72, window 16) within
    the tolerance (measured: 0.02 and 0.46 of it); the reference without each piece far
    outside it, in the chunk and in the round alike."""
    ref, _, toks, lr, lg, _ = run
    atol = 4e-2 * lr.abs().max().item()
    torch.testing.assert_close(lg, lr, atol=atol, rtol=0)
    # (the piece taken out, the least distance of its control in units of atol in the chunk
    # and in the round; measured: chunk, round)
    controls = [({"sliding_window": 10 ** 6}, 10),           # 32, 28: the window off, its rope kept
                ({"rope_base_swa": ref.cfg.rope_base}, 5),   # 23, 9.8: the SWA layers' own rope base
                ({"post_norms": False}, 10),                 # 34, 26
                ({"ffn_act": "silu"}, 2),                    # 6.9, 4.9: GeGLU, not SwiGLU
                ({"embed_scale": 1.0}, 10),                  # 37, 29
                ({"final_softcap": 0.0}, 10)]                # 34, 19
    for change, least in controls:
        lc = _without(ref, toks, **change)
        for rows in (slice(0, PROMPT), slice(PROMPT, None)):
            assert (lc[rows] - lr[rows]).abs().max() > least * atol, (change, rows)


def test_round_equals_single_rows(run):
    """The round of 3 rows past the window equals the rows run one at a time, bit for bit."""
    _, gpu, toks, _, lg, cache = run
    cache.truncate(PROMPT)
    singles = torch.cat([gpu.forward(toks[i:i + 1], i, cache)[0].clone() for i in range(PROMPT, PROMPT + ROUND)])
    assert torch.equal(singles.cpu(), lg[PROMPT:])


@pytest.mark.parametrize("pos, T", [(0, 20), (3, 5), (30, 5)])
def test_prefill_attention_window(pos, T):
    """The prefill's SDPA with a window of 8 and a q.k scale of 0.3 against the reference's
    attention: a first chunk longer than the window, a chunk inside it (the causal path), a
    later chunk after a prefix (the explicit mask at pos > 0)."""
    g = torch.Generator().manual_seed(pos)
    q = torch.randn(T, 4, 16, generator=g).half().float()                        # (SDPA on CUDA: fp16)
    k, v = (torch.randn(2, pos + T + 6, 16, generator=g).half() for _ in range(2))   # rows past pos+T: junk
    out = prefill_attention(q.to(DEV), k.to(DEV), v.to(DEV), pos, torch.float32, 0.3, 8).cpu()
    ref = attention(q, k[:, :pos + T].float(), v[:, :pos + T].float(), pos, 0.3, 8)     # [T, 4*16]
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
