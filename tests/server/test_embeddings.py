"""/v1/embeddings, /embeddings and /embedding against llama.cpp's embeddings of the same
inputs (llama-server --embeddings --pooling mean|last|cls; tests/data/reference/
llama-routes-*.json, made by bench/llama_server_routes_reference.py), through the real
`openai` client and plain HTTP."""
from __future__ import annotations

import json
from importlib.resources import files

import httpx
import numpy as np
import pytest
import torch

from alphallama.engine import Engine
from alphallama.server.embeddings import normalize
from conftest import REFERENCE, STORIES
from serverutil import _one_torch_thread, serve  # noqa: F401  (fixtures)

REF = json.loads((REFERENCE / "llama-routes-stories260K.json").read_text())
EMBEDDED = files("alphallama") / "data" / "alphallama-embedded.gguf"


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load(str(STORIES))


@pytest.fixture(scope="module")
def server(engine):
    with serve(engine, STORIES) as s:
        yield s


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base + path, json=body, headers=server.headers, timeout=60)


def close_to(got, want, tol: float = 1e-3, cos: float = 1e-5) -> None:
    """Within tol of llama.cpp's vector everywhere, cosine within cos of 1 (its K/V cache is
    float16: differences of ~1e-4 on a unit vector of stories260K are its rounding)."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    assert np.abs(got - want).max() < tol and got @ want > 1 - cos


def test_openai_client_matches_llama_cpp_mean_pooling(server):
    ref = REF["embeddings"]["mean"]
    # the openai client asks for base64 and decodes it itself
    r = server.client().embeddings.create(model="anything", input=[c["input"] for c in ref])
    assert r.object == "list" and r.model == "anything" and [d.index for d in r.data] == [0, 1, 2]
    for d, c in zip(r.data, ref):
        close_to(d.embedding, c["embedding"])
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(c["ids"]) for c in ref)
    one = server.client().embeddings.create(model="x", input=ref[0]["input"], encoding_format="float")
    close_to(one.data[0].embedding, ref[0]["embedding"])


def test_token_id_inputs_and_the_native_shape(server):
    ref = REF["embeddings"]["mean"]
    r = post(server, "/v1/embeddings", {"input": ref[1]["ids"]}).json()
    assert r["data"][0]["object"] == "embedding" and r["usage"]["prompt_tokens"] == len(ref[1]["ids"])
    close_to(r["data"][0]["embedding"], ref[1]["embedding"])
    both = post(server, "/v1/embeddings", {"input": [ref[0]["ids"], ref[2]["input"]]}).json()["data"]
    close_to(both[1]["embedding"], ref[2]["embedding"])
    for path in ("/embeddings", "/embedding"):   # llama-server's own shape: [{index, embedding: [[...]]}]
        native = post(server, path, {"content": [c["input"] for c in ref]}).json()
        assert [n["index"] for n in native] == [0, 1, 2] and all(len(n["embedding"]) == 1 for n in native)
        for n, c in zip(native, ref):
            close_to(n["embedding"][0], c["embedding"])


@pytest.mark.parametrize("pooling", ["last", "cls"])
def test_other_poolings_match_llama_cpp(engine, pooling):
    with serve(engine, STORIES, pooling=pooling) as s:
        for c in REF["embeddings"][pooling]:
            r = post(s, "/v1/embeddings", {"input": c["input"]}).json()
            close_to(r["data"][0]["embedding"], c["embedding"])


def test_embd_normalize(server):
    text = REF["embeddings"]["mean"][0]["input"]

    def vec(p: int) -> np.ndarray:
        return np.asarray(post(server, "/v1/embeddings", {"input": text, "embd_normalize": p}).json()
                          ["data"][0]["embedding"], dtype=np.float64)
    raw = vec(-1)
    close_to(raw / np.linalg.norm(raw), REF["embeddings"]["mean"][0]["embedding"])
    assert np.abs(vec(1)).sum() == pytest.approx(1, abs=1e-5)
    assert np.abs(vec(0)).max() == pytest.approx(32760, rel=1e-6)
    assert (np.abs(vec(3)) ** 3).sum() == pytest.approx(1, abs=1e-5)


def test_normalize_against_float64():
    v = torch.randn(33, generator=torch.Generator().manual_seed(0))
    x = v.double().numpy()
    for p, norm in [(2, np.linalg.norm(x)), (1, np.abs(x).sum()), (5, (np.abs(x) ** 5).sum() ** 0.2),
                    (0, np.abs(x).max() / 32760.0), (-1, 1.0)]:
        assert np.allclose(normalize(v, p).numpy(), x / norm, rtol=1e-6, atol=1e-7), p
    assert normalize(torch.zeros(4), 2).tolist() == [0.0] * 4


def test_embedding_then_completion_gives_the_same_text(server):
    body = {"prompt": "Once upon a time there", "n_predict": 16}
    first = post(server, "/completion", body).json()
    post(server, "/v1/embeddings", {"input": "Once upon a time, in a land"})   # overwrites the cache rows
    again = post(server, "/completion", body).json()
    assert again["content"] == first["content"]
    assert again["timings"]["cache_n"] >= 4   # the embedding's rows of the shared prefix were re-used


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "dimensions": 3}, "dimensions"),
    ({"input": [1, 70000]}, "input[1]"),
    ({"input": 5}, "input"),
])
def test_bad_inputs_are_400(server, body, param):
    r = post(server, "/v1/embeddings", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_input_longer_than_the_context(server):
    ctx = server.state.worker.engine.ctx_size
    r = post(server, "/v1/embeddings", {"input": ["short", [1] * (ctx + 1)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[1]"
    assert r.json()["error"]["type"] == "exceed_context_size_error"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_embedded_model_matches_llama_cpp(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    ref = json.loads((REFERENCE / "llama-routes-alphallama-embedded.json").read_text())
    engine = Engine.load(str(EMBEDDED), device=device)
    for c in ref["embeddings"]["mean"]:
        ids = engine.tokenizer.encode(c["input"], add_special=True, parse_special=True)
        assert ids == c["ids"]
        v = normalize(engine.final_hidden(ids).mean(0), 2)
        # Q8_0 matrices: llama.cpp quantizes the activations too (its dot products are int8); on the
        # 2026-12-07 model that moves a mean-pooled unit vector by up to 2.8e-3 (cosine 1 - 1.3e-4)
        close_to(v.numpy(), c["embedding"], tol=5e-3, cos=3e-4)
