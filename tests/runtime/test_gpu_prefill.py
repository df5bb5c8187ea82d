"""The tensor-core prefill path (calls of more than 64 rows: kernels/prefill/qgemm.py + SDPA,
runtime/gpu_prefill.py) against the reference transformer, from an empty cache and
after a cached prefix, for a dense and an MoE model; and exact speculative == plain
greedy decoding with a prompt long enough to take that path."""
from __future__ import annotations


import pytest
import torch


from alphallama.engine import Engine, Generation  # noqa: E402
from alphallama.gguf.reader import GGUFFile  # noqa: E402
from alphallama.gguf.writer import PRESETS, write_synthetic  # noqa: E402
from alphallama.model.loader import load_model  # noqa: E402
from alphallama.runtime.gpu_model import MAX_W, ROWS_PER_THREAD, GPUModel  # noqa: E402
from alphallama.runtime.gpu_prefill import prefill_rows  # noqa: E402
from alphallama.runtime.overrides import Overrides  # noqa: E402
from alphallama.spec.config import SpecConfig  # noqa: E402
from alphallama.tokenizer import Tokenizer  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CTX = 160
N1, N2 = 70, 66          # both > MAX_W: two prefill calls, the second over a cached prefix


def _load(tmp_path_factory, preset, quant, chunk=48):
    """(file, reference, GPU model on the prefill path in chunks of `chunk`: 48 makes the
    70 rows of N1 48 + 22, a chunk boundary inside one call)."""
    path = tmp_path_factory.mktemp("m") / f"{preset}.gguf"
    write_synthetic(PRESETS[preset](n_layers=1, quant=quant, seed=3), path)
    f = GGUFFile(path)
    gpu = GPUModel(f, CTX, device=DEV, prefill_chunk=chunk, overrides=Overrides(prefill_path="dequant"))
    return f, load_model(f, CTX), gpu


@pytest.fixture(scope="module", params=[("tiny-qwen3", "Q4_K"), ("tiny-qwen3moe", "Q8_0")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def models(request, tmp_path_factory):
    # chunks of N2: N1 is N2 + 4 (a chunk boundary inside one call), N2 one chunk
    return _load(tmp_path_factory, *request.param, chunk=N2)


def test_prefill_path_matches_reference(models):
    _, ref, gpu = models
    assert gpu.prefill_path == "dequant" and N1 > MAX_W and N2 > MAX_W
    toks = torch.randint(0, ref.cfg.vocab_size, (N1 + N2,), generator=torch.Generator().manual_seed(4))
    lr, hr = ref.forward(toks, 0, ref.new_cache(CTX))                   # [N1 + N2, V], [N1 + N2, D]
    cache = gpu.new_cache(CTX)
    _, h1 = gpu.forward(toks[:N1], 0, cache, logits=False)
    h1 = h1.clone()
    l2, h2 = gpu.forward(toks[N1:], N1, cache)                          # attends to the cached prefix
    assert cache.length == N1 + N2
    hg = torch.cat([h1, h2]).cpu()
    # fp16 K/V and attention inputs against an fp32 reference. An MoE router's top-k is
    # discontinuous: where two experts nearly tie, the fp16 path may pick the other one
    # and that row moves far (seen on the H200: 1 row of 136). Such rows are allowed for
    # MoE, at most 2; every other row must be close.
    tol_h, tol_l = 2e-2 * hr.abs().max().item(), 2e-2 * lr.abs().max().item()
    bad_h = ((hg - hr).abs() > tol_h).any(-1)                           # [N1 + N2]
    bad_l = ((l2.cpu() - lr[N1:]).abs() > tol_l).any(-1)                # [N2]
    flips = 2 if ref.cfg.is_moe else 0
    assert int(bad_h.sum()) <= flips and int(bad_l.sum()) <= flips, (int(bad_h.sum()), int(bad_l.sum()))
    assert (l2.argmax(-1).cpu() == lr[N1:].argmax(-1)).float().mean() >= 0.95
    # two scratch buffers, each weight dequantized one GEMM ahead (MoE: planned again after
    # the experts): the same products, bit for bit (the first call's last chunk again)
    overlap = gpu.scratch.overlap
    try:
        gpu.scratch.overlap = not overlap
        _, h1b = prefill_rows(gpu, toks[N2:N1].to(DEV), N2, cache, False, ROWS_PER_THREAD)   # [N1 - N2, D]
        assert torch.equal(h1b.cpu(), hg[N2:N1])
    finally:
        gpu.scratch.overlap = overlap


def test_spec_equals_plain_with_a_long_prompt(tmp_path_factory):
    f, _, gpu = _load(tmp_path_factory, "tiny-qwen3", "Q8_0")
    engine = Engine(f, gpu, Tokenizer.from_metadata(f.metadata), None, CTX)
    g = torch.Generator().manual_seed(8)
    base = torch.randint(gpu.cfg.vocab_size, (23,), generator=g).tolist()
    prompt = base * 3                   # 69 rows: 68 through the prefill path, repeats for the copy drafter
    g0, g1 = Generation(), Generation()
    plain = list(engine.generate(prompt, 6, gen=g0))
    engine.reset()                      # the spec run prefills the prompt again, from scratch
    # no gate: it would time the round widths first (seconds in the interpreter)
    spec = list(engine.generate(prompt, 6, gen=g1, spec=SpecConfig("ngram", 8, 1, gate=False)))
    assert spec == plain and len(plain) == 6 and g1.stats.draft_n > 0


@pytest.mark.parametrize("pos", [0, 3])
def test_prefill_attention_matches_float64(pos):
    """SDPA on [1, H, T, hd] (GQA by repeated K/V heads, causal bottom-right over a
    cached prefix) against the plain formula in float64."""
    from alphallama.runtime.gpu_prefill import prefill_attention
    g = torch.Generator().manual_seed(0)
    T, H, n_kv, hd, L = 5, 4, 2, 8, pos + 5
    q = torch.randn(T, H, hd, generator=g)
    k, v = torch.randn(n_kv, 20, hd, generator=g), torch.randn(n_kv, 20, hd, generator=g)  # rows past L: unused
    o = prefill_attention(q, k, v, pos, torch.float32)                              # [T, H*hd]
    kr = k[:, :L].double().repeat_interleave(H // n_kv, 0)                           # [H, L, hd]
    vr = v[:, :L].double().repeat_interleave(H // n_kv, 0)
    s = q.transpose(0, 1).double() @ kr.transpose(1, 2) / hd ** 0.5                  # [H, T, L]
    seen = torch.arange(L)[None, :] <= (pos + torch.arange(T))[:, None]              # [T, L]
    ref = (s.masked_fill(~seen, float("-inf")).softmax(-1) @ vr).transpose(0, 1).reshape(T, H * hd)
    torch.testing.assert_close(o.double(), ref, atol=1e-5, rtol=0)


def _stand_in_capture(gp, monkeypatch):
    """On CPU, a stand-in for a CUDA graph: "replay" re-runs the captured stretch into the
    same output tensor. No warm-up (on CUDA it compiles the kernels; here the capture's own
    run of each stretch comes first)."""
    def capture(fn, pool):
        out = fn()
        return (lambda: fn() if out is None else out.copy_(fn())), out

    monkeypatch.setattr(gp, "_warm_up", lambda fn, device: None)
    monkeypatch.setattr(gp, "_graph_pool", lambda: None)
    monkeypatch.setattr(gp, "_capture", capture)


def test_chunk_graphs_dataflow_matches_eager(tmp_path_factory, monkeypatch):
    """ChunkGraphs' static buffers (residual, position, attention output, each stretch's
    q, the head's logits) and replay order, on CPU: a stand-in for a CUDA graph re-runs
    the captured stretch into the same output tensor. Two chunks (the second over the
    first's cached rows) give the eager chunks' logits, hidden rows and K/V bit for bit."""
    from alphallama.runtime import gpu_prefill as gp

    _stand_in_capture(gp, monkeypatch)
    _, _, gpu = _load(tmp_path_factory, "tiny-qwen3", "Q4_K")
    T = 8                                   # any chunk size (the engine's: prefill_chunk)
    toks = torch.randint(0, gpu.cfg.vocab_size, (2 * T,), generator=torch.Generator().manual_seed(6))
    emb = gpu.embed
    eager_cache = gpu.new_cache(CTX)
    eager = [gp.prefill_rows(gpu, toks[s:s + T], s, eager_cache, True, 4) for s in (0, T)]
    graph_cache = gpu.new_cache(CTX)
    gpu.scratch.overlap = True              # each stretch planned and joined on its own (two buffers)
    try:
        chunk = gp.ChunkGraphs(gpu, graph_cache, T, True, 0, 4)
        # no reference back to the model, which keeps the chunk (Scratch.captured): no cycle for
        # the collector to free inside some later capture (runtime/capture.py)
        assert all(v is not gpu for v in vars(chunk).values())
        for s, (le, he) in zip((0, T), eager):
            lg, hg = chunk.run(emb(toks[s:s + T]), s)
            assert torch.equal(lg, le) and torch.equal(hg, he)
    finally:
        gpu.scratch.overlap = False
    assert torch.equal(graph_cache.k[:, :, :2 * T], eager_cache.k[:, :, :2 * T])
    assert torch.equal(graph_cache.v[:, :, :2 * T], eager_cache.v[:, :, :2 * T])


@pytest.mark.parametrize("preset,quant", [("tiny-qwen3", "Q4_K"), ("tiny-qwen3moe", "Q8_0")])
def test_short_chunks_run_padded_in_the_graphs(tmp_path_factory, monkeypatch, preset, quant):
    """A chunk shorter than prefill_chunk runs in the graphs of graph_rows(T) rows, its
    tail padded (on CPU with a stand-in for the capture, as above): the real rows' logits,
    hidden rows and K/V match the eager chunk's, for a dense and an MoE model (its
    experts through moe_prefill); one graph set per shape is kept."""
    from alphallama.runtime import gpu_prefill as gp

    _stand_in_capture(gp, monkeypatch)
    monkeypatch.setattr(gp, "GRAPH_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(gp, "GRAPH_MIN_ROWS", 8)
    assert [gp.graph_rows(T, 48) for T in (5, 8, 9, 16, 17, 33, 48)] == [8, 8, 16, 16, 32, 48, 48]
    _, _, gpu = _load(tmp_path_factory, preset, quant)
    toks = torch.randint(0, gpu.cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(8))
    gpu.scratch.graphs = False
    eager_cache = gpu.new_cache(CTX)
    eager = [gp.prefill_rows(gpu, toks[:10], 0, eager_cache, True, 4),      # 10 of 48: graphs of 16
             gp.prefill_rows(gpu, toks[10:15], 10, eager_cache, True, 4)]   # 5: graphs of 8
    gpu.scratch.graphs = True
    try:
        graph_cache = gpu.new_cache(CTX)
        graph = [gp.prefill_rows(gpu, toks[:10], 0, graph_cache, True, 4),
                 gp.prefill_rows(gpu, toks[10:15], 10, graph_cache, True, 4)]
        assert sorted(k[0] for k in gpu.scratch.captured) == [8, 16]
    finally:
        gpu.scratch.graphs = False
        gpu.scratch.captured.clear()
    # the padded chunk is another GEMM shape (16 or 8 rows against 10 or 5), so the host BLAS may
    # take another kernel: the same sums in another order. 5e-4 of the largest (1.2e-4 was seen
    # on one host's MKL for the MoE model); a wrong row, weight or pad is far beyond it
    for (le, he), (lg, hg) in zip(eager, graph):
        assert lg.shape == le.shape and hg.shape == he.shape
        torch.testing.assert_close(lg, le, atol=5e-4 * le.abs().max().item(), rtol=0)
        torch.testing.assert_close(hg, he, atol=5e-4 * he.abs().max().item(), rtol=0)
    torch.testing.assert_close(graph_cache.k[:, :, :15], eager_cache.k[:, :, :15], atol=2e-3, rtol=0)
    torch.testing.assert_close(graph_cache.v[:, :, :15], eager_cache.v[:, :, :15], atol=2e-3, rtol=0)


def test_every_model_prefills_through_the_tensor_cores(tmp_path):
    """config prefill_path: MoE and dense models take long prompts through the tensor-core
    path by default (resident experts as grouped GEMMs), and an explicit choice wins."""
    paths = {}
    for preset in ("tiny-qwen3moe", "tiny-qwen3"):
        paths[preset] = tmp_path / f"{preset}.gguf"
        write_synthetic(PRESETS[preset](n_layers=1, quant="Q8_0", seed=3), paths[preset])
    assert GPUModel(GGUFFile(paths["tiny-qwen3moe"]), CTX, device=DEV).prefill_path == "dequant"
    assert GPUModel(GGUFFile(paths["tiny-qwen3"]), CTX, device=DEV).prefill_path == "dequant"
    gemv = Overrides(prefill_path="gemv")
    assert GPUModel(GGUFFile(paths["tiny-qwen3moe"]), CTX, device=DEV, overrides=gemv).prefill_path == "gemv"


@pytest.fixture(scope="module")
def moe_layer(request, tmp_path_factory):
    """The MoE layer of a one-layer tiny-qwen3moe of type request.param (indirect)."""
    path = tmp_path_factory.mktemp("moe") / f"moe-{request.param}.gguf"
    write_synthetic(PRESETS["tiny-qwen3moe"](n_layers=1, quant=request.param, seed=3), path)
    return GPUModel(GGUFFile(path), CTX, device=DEV, overrides=Overrides(prefill_path="dequant")).layers[0].moe


def _routing(case: str, T: int, g: torch.Generator) -> torch.Tensor:
    """Expert ids [T, 2] of 8 experts: all used; holes (1, 4, 5 unused); 3-5 unused; expert 5 in every row."""
    def pick(pool):   # two distinct experts of `pool` per row
        pool = torch.tensor(pool)
        return torch.stack([pool[torch.randperm(len(pool), generator=g)[:2]] for _ in range(T)])
    if case == "all":
        return pick(range(8)).int()
    if case == "holes":                    # 1, 4, 5 unused: a hole inside a batch, a batch trimmed to one expert
        return pick([0, 2, 3, 6, 7]).int()
    if case == "empty_batch":              # 3-5 unused: a batch skipped
        return pick([0, 1, 6, 7]).int()
    e = torch.stack([torch.full((T,), 5), pick([0, 2, 3, 6, 7])[:, 0]], 1)   # expert 5 takes every row
    e[::2] = e[::2].flip(1)                                                    # in either rank
    return e.int()


# Every routing on Q8_0 in fp32; Q4_K's block decoder in both dtypes and the bf16 scratch on
# Q8_0 once each: the routing (moe_align, the blocks) is the same code for every type and
# dtype, the type only the weight tile's decoder (the full cross, 16 cases, was CI time)
MOE_CASES = [pytest.param(q, case, dt, id=f"{q}-{name}-{case}") for q, case, dt, name in [
    *[("Q8_0", case, torch.float32, "f32") for case in ("all", "holes", "empty_batch", "one_takes_all")],
    ("Q8_0", "one_takes_all", torch.bfloat16, "bf16"),
    ("Q4_K", "empty_batch", torch.float32, "f32"), ("Q4_K", "holes", torch.bfloat16, "bf16")]]


@pytest.mark.parametrize("moe_layer,case,dtype", MOE_CASES, indirect=["moe_layer"])
def test_moe_prefill_matches_loop(moe_layer, case, dtype):
    """moe_gemm.moe_prefill (padded per-expert blocks) against moe_loop on the same
    routing: unused experts, a run of unused ones, one expert taking every row (more
    than one block), in the scratch dtype of the CPU (fp32) and of the GPU (bf16)."""
    from alphallama.kernels.moe.moe_gemm import moe_prefill
    from alphallama.runtime.scratch import Scratch
    from alphallama.runtime import gpu_prefill as gp
    g = torch.Generator().manual_seed(11)
    T, D = 20, moe_layer.down.N
    experts = _routing(case, T, g).to(DEV)
    w = torch.rand(T, 2, generator=g).to(DEV)
    h = torch.randn(T, D, generator=g).to(dtype).to(DEV)
    out = moe_prefill(h, w, experts, moe_layer.gate_up, moe_layer.down, (32, 4, 2))   # [T, D]
    ref = gp.moe_loop(moe_layer, h, w, experts, Scratch(1 << 21, dtype, DEV))           # [T, D]
    assert out.dtype == torch.float32 and out.shape == (T, D)
    tol = (1e-5 if dtype == torch.float32 else 2e-2) * ref.abs().max().item()
    torch.testing.assert_close(out, ref, atol=tol, rtol=0)


def test_moe_prefill_takes_the_fused_path(tmp_path_factory, monkeypatch):
    """By default a resident-expert MoE chunk runs its experts through moe_gemm.moe_prefill
    (one call a layer and chunk, no host sync), close to the per-expert loop; an expert
    store's layers never do (their experts are not all on the device)."""
    from alphallama.runtime import gpu_prefill as gp
    f, _, gpu = _load(tmp_path_factory, "tiny-qwen3moe", "Q8_0")
    assert gpu.layers[0].moe.prefill_fused and gp.capturable(gpu.layers[0])
    calls = []
    real = gp.moe_prefill
    monkeypatch.setattr(gp, "moe_prefill", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    toks = torch.randint(0, gpu.cfg.vocab_size, (N1,), generator=torch.Generator().manual_seed(5))
    _, hf = gpu.forward(toks, 0, gpu.new_cache(CTX), logits=False)
    hf = hf.clone()
    # chunks of 48 + 22, one MoE layer; where chunks are captured, the short one runs padded
    graphs = gpu.device.type in gp.GRAPH_DEVICES and gpu.scratch.graphs
    assert calls == [48, gp.graph_rows(22, 48) if graphs else 22]
    loop = GPUModel(f, CTX, device=DEV, prefill_chunk=48,
                    overrides=Overrides(prefill_path="dequant", moe_prefill_fused=False))
    _, hl = loop.forward(toks, 0, loop.new_cache(CTX), logits=False)
    assert len(calls) == 2
    # the GPU's bf16 scratch: the two paths round their products apart (the H200 moved 8 of
    # 17,920 values by 1.1e-4 of the largest)
    tol = 1e-4 if gpu.scratch.dtype == torch.float32 else 1e-3
    torch.testing.assert_close(hf, hl, atol=tol * hl.abs().max().item(), rtol=0)
