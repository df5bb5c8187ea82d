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

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("ALPHA_SHARED", ROOT.parent / "shared"))
DATA = SHARED / "data"
STORIES = DATA / "models" / "stories260K.gguf"
VOCAB = DATA / "vocab"
REFERENCE = DATA / "reference"
MODELS_DIR = Path(os.environ.get("ALPHA_MODELS", Path.home() / ".cache" / "alphallama" / "models"))
QWEN = MODELS_DIR / "qwen2.5-coder-0.5b-instruct.gguf"


def require(path: Path, how: str = "") -> Path:
    if not path.exists():
        pytest.skip(f"{path} is not present{': ' + how if how else ''}")
    return path


@pytest.fixture(scope="session")
def stories_path() -> Path:
    return require(STORIES, "../shared/data is missing")


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    return require(QWEN, "assemble it with ../shared/tools/fetch-models.sh")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a shared CPU: two contended intra-op threads run many times slower
    than one. Modules of tiny-model tests opt in with pytestmark = usefixtures("one_thread")."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
