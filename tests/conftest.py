"""Shared test fixtures: where the reference data and the optional real models live."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in the interpreter. This must hold before any
# module decorates a kernel (the first import of alphallama.kernels decides it for the
# whole run), so it is set here rather than in each test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# xdist workers share the cores: a worker's intra-op threads beyond its share only contend
# (OpenMP's spinning threads against the other worker's)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

ROOT = Path(__file__).resolve().parents[1]
# The small reference files travel with the tests (tests/data/README.md): a fresh clone
# runs the suite without anything beside it. The large ones stay in ../shared/data; the
# tests that read them are marked `shared` (.ci/run runs them with `-m shared` where
# ../shared exists) and skip elsewhere, naming the file.
TEST_DATA = ROOT / "tests" / "data"
SHARED = Path(os.environ.get("ALPHA_SHARED", ROOT.parent / "shared"))
DATA = SHARED / "data"
STORIES = TEST_DATA / "models" / "stories260K.gguf"
SPM_VOCAB = TEST_DATA / "vocab" / "ggml-vocab-llama-spm.gguf"
VOCAB = DATA / "vocab"                  # qwen2 and llama-bpe (6-8 MB each): ../shared only
REFERENCE = TEST_DATA / "reference"
TEMPLATES = TEST_DATA / "templates"
MODELS_DIR = Path(os.environ.get("ALPHA_MODELS", Path.home() / ".cache" / "alphallama" / "models"))
QWEN = MODELS_DIR / "qwen2.5-coder-0.5b-instruct.gguf"


def require(path: Path, how: str = "") -> Path:
    if not path.exists():
        pytest.skip(f"{path} is not present{': ' + how if how else ''}")
    return path


def vocab_path(name: str) -> Path:
    """ggml-vocab-{name}.gguf: from tests/data where it is small enough to commit, else ../shared."""
    local = TEST_DATA / "vocab" / f"ggml-vocab-{name}.gguf"
    return local if local.exists() else VOCAB / local.name


@pytest.fixture(scope="session")
def stories_path() -> Path:
    return require(STORIES, "it is committed with the tests (tests/data)")


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    """The real Qwen model: its tests take minutes on a CPU, so they run in the ../shared
    pass only (`pytest -m shared`; mark them `shared`), where the tool that assembles it is."""
    require(SHARED, "the long real-model tests run only beside ../shared")
    return require(QWEN, "assemble it with ../shared/tools/fetch-models.sh")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a shared CPU: two contended intra-op threads run many times slower
    than one. Modules of tiny-model tests opt in with pytestmark = usefixtures("one_thread")."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# The slowest files first. With the README's `-n 2 --dist loadfile` each file runs whole on one
# of the two workers, and pytest-xdist would order files by their number of tests, leaving a
# few slow files of few tests (test_gpu_fast: 5 tests, ~200 s) to run alone at the end; in this
# order the two workers finish together. Rough CPU seconds on a 2-core machine, largest first.
SLOW_FIRST = ("runtime/test_gpu_prefill.py", "runtime/test_gpu_model.py", "runtime/test_golden.py",
              "runtime/test_gpu_fast.py", "offload/test_store.py", "spec/test_exact.py", "kernels/test_qgemv_i8.py",
              "kernels/test_qmatmul.py", "runtime/test_gpu_mtp.py", "kernels/test_moe_gemm.py",
              "runtime/test_gpu_rope.py", "gguf/test_reader_fuzz.py", "kernels/test_qgemv_mma.py",
              "runtime/test_gpu_gemma3.py", "kernels/test_gpu_quant_types.py", "runtime/test_gpu_shared_expert.py",
              "kernels/test_gpu_quant_types_iq.py", "runtime/test_gpu_quant_types_iq_model.py",
              "runtime/test_gpu_hybrid.py", "offload/test_mapped_store.py", "test_engine_streams.py",
              "test_engine_penalties.py",
              "runtime/test_gpu_hybrid_mtp.py", "runtime/test_gpu_gpt_oss.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):   # pytest-xdist: keep the order below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))
