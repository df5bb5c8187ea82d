"""Issue 32's GPU quant types in a whole model: a synthetic file in them loads into
the GPU runtime (Triton kernels; the interpreter on CPU), `plan`'s support check names the
GPU for every tensor, the logits follow the reference transformer's, and a verify round
equals its rows run alone (exact mode)."""
from __future__ import annotations


import torch
from gguf import GGMLQuantizationType as T


from alphallama.gguf.reader import GGUFFile  # noqa: E402
from alphallama.gguf.writer import PRESETS, write_synthetic  # noqa: E402
from alphallama.model.loader import load_model  # noqa: E402
from alphallama.offload.support import gpu_problems, type_uses  # noqa: E402
from alphallama.runtime.gpu_model import GPUModel  # noqa: E402
from gpucheck import follows_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# one MoE model holding the six: Q4_1 for the embedding's gather and the routed experts'
# gate|up, Q5_1 for the attention output and the experts' down, q in Q2_K, k in Q3_K, v in
# IQ4_NL (all three on qgemv_i8, in two lane orders: Q2_K and Q3_K Q8_0's, IQ4_NL Q4_K's), the
# head in IQ4_XS (qgemv_i8)
MIX = {g: T.Q4_1 for g in ("embd", "ffn_gate_exps", "ffn_up_exps")} | \
      {g: T.Q5_1 for g in ("attn_output", "ffn_down_exps")} | \
      {"attn_q": T.Q2_K, "attn_k": T.Q3_K, "attn_v": T.IQ4_NL, "output": T.IQ4_XS}


def test_model_in_the_new_types_runs_on_the_gpu_path(tmp_path):
    path = tmp_path / "tiny-qwen3moe.gguf"
    write_synthetic(PRESETS["tiny-qwen3moe"](n_layers=1, quant=MIX, seed=3), path)
    f = GGUFFile(path)
    assert gpu_problems(f.tensors) == []
    uses = type_uses(f.tensors)
    assert all(uses[q.name].runs_on == "cpu+gpu" for q in set(MIX.values()))
    ref, gpu = load_model(f, 128), GPUModel(f, 128, device=DEV)
    toks = torch.randint(0, ref.cfg.vocab_size, (5,), generator=torch.Generator().manual_seed(0))
    follows_reference(ref, gpu, toks, 128, alone_from=3)
