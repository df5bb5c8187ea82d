"""The CPU path runs on a machine without triton (the README's first command installs
the CPU torch wheel, which does not bring it): only the GPU kernels and the GPU runtime
import it, and only when a CUDA device is used.

Each check runs in a fresh interpreter whose import system refuses `triton`, so the
test proves it even here, where triton is installed."""
from __future__ import annotations

import json
import os
import subprocess
import sys

BLOCK = """
import sys
class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTriton())
"""

# Modules that are GPU-only by design: the Triton kernels (apart from the torch-only
# weight formats and the references) and the CUDA runtime built on them.
GPU_ONLY = ("alphallama.kernels.", "alphallama.runtime.gpu_", "alphallama.runtime.round", "alphallama.runtime.scratch",
            "alphallama.runtime.linear", "alphallama.runtime.moe", "alphallama.runtime.weights", "alphallama.runtime.graphs",
            "alphallama.runtime.shared_expert", "alphallama.runtime.hybrid_", "alphallama.runtime.store_rounds")
TORCH_ONLY_KERNELS = {"alphallama.kernels.formats.qweight", "alphallama.kernels.formats",
                      "alphallama.kernels.formats.format", "alphallama.kernels.formats.fmt_float",
                      "alphallama.kernels.formats.fmt_legacy", "alphallama.kernels.formats.fmt_kquant",
                      "alphallama.kernels.gemv.mma_layout", "alphallama.kernels.moe.expert_q8",
                      "alphallama.kernels.moe.mailbox_layout", "alphallama.kernels.activations.act_ids",
                      "alphallama.kernels.deltanet.layout"}


def _python(code: str) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter that cannot import triton and sees no GPU."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, timeout=300, env=env)


def test_only_gpu_modules_need_triton():
    r = _python("""
import importlib, json, pkgutil, alphallama
failed = {}
for m in pkgutil.walk_packages(alphallama.__path__, "alphallama."):
    try:
        importlib.import_module(m.name)
    except ModuleNotFoundError as e:
        failed[m.name] = e.name
print(json.dumps(failed))
""")
    assert r.returncode == 0, r.stderr
    failed = json.loads(r.stdout.splitlines()[-1])
    assert set(failed.values()) <= {"triton", "triton.language"}, failed
    assert all(name.startswith(GPU_ONLY) for name in failed), sorted(n for n in failed if not n.startswith(GPU_ONLY))
    assert not TORCH_ONLY_KERNELS & set(failed), sorted(TORCH_ONLY_KERNELS & set(failed))
    assert "alphallama.kernels.gemv.qmatmul" in failed   # the blocker works: a real kernel module is refused


def test_readme_run_command_without_triton():
    """`alphallama run -p ... -n N` on the embedded model, as the README's first command."""
    r = _python("""
import sys
from alphallama.cli import main
rc = main(["run", "-p", "def is_palindrome(s):", "-n", "8", "--json"])
assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules), "triton was imported"
sys.exit(rc)
""")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout[r.stdout.index("{"):])
    assert len(out["gen_ids"]) == 8 and out["prompt_ids"]


def test_every_format_has_its_triton_side():
    """The split keeps one Triton load/field pair for every host-side format: a format
    the planner and the store accept is one the GPU kernels can read."""
    from alphallama.kernels import FORMATS
    from alphallama.kernels.formats.format import triton_kernels
    assert set(triton_kernels()) == set(FORMATS)


def test_plan_of_a_hybrid_without_triton(tmp_path):
    """`alphallama plan` sizes a Gated DeltaNet hybrid's cache (its recurrent rows) with no
    Triton to import: a user without a GPU asks what their file needs."""
    from alphallama.gguf.writer import PRESETS, write_synthetic
    path = tmp_path / "hybrid.gguf"
    write_synthetic(PRESETS["tiny-qwen35moe"](), path)
    r = _python(f"""
import sys
from alphallama.cli import main
rc = main(["plan", "-m", {str(path)!r}, "--gpu-mem", "2G", "--no-probe", "--json"])
assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules), "triton was imported"
sys.exit(rc)
""")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout[r.stdout.index("{"):])
    from alphallama.gguf.arch import load_config
    from alphallama.gguf.reader import GGUFFile
    from alphallama.kernels.deltanet.layout import RING_ROWS, W_MAX
    from alphallama.offload.plan import KV_PAD_ROWS
    c = load_config(GGUFFile(str(path)))
    kv = 2 * len(c.attn_layers) * c.n_kv_heads * (plan["ctx"] + KV_PAD_ROWS) * c.head_dim * 2
    state = 4 * len(c.recurrent_layers) * (RING_ROWS * c.conv_dim + c.ssm_v_heads * c.ssm_head_dim ** 2
                                           + W_MAX * 2 * c.ssm_v_heads)
    assert plan["sizes"]["kv"] == kv + state     # (the cache's own tensors: tests/runtime/test_gpu_hybrid_store.py)
