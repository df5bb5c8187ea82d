"""Writing the trained model: the main GGUF (only the tensors llama.cpp loads for
`qwen3moe`), the MTP sidecar `<stem>.mtp.gguf` beside it, provenance metadata in both.
Splitting them into checked parts for the trip back from the device is parts.py's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from gguf import GGMLQuantizationType as QT
from gguf import LlamaFileType

from ..gguf.arch import expected_tensors
from .model import MoEModel
from .mtp import MTPHead, add_gguf_tensor, add_metadata, write_sidecar

PROVENANCE = "alphallama.training."   # .command .date .corpus_manifest_sha256 .steps .tokens ...
# the matrices' types the export writes (gguf.quants quantizes them; not the k-quants) -> the
# file's general.file_type (what each costs the shipped model: decisions/embedded-model.md)
FILE_TYPES = {QT.F32: LlamaFileType.ALL_F32, QT.F16: LlamaFileType.MOSTLY_F16, QT.Q8_0: LlamaFileType.MOSTLY_Q8_0,
              QT.Q5_1: LlamaFileType.MOSTLY_Q5_1, QT.Q5_0: LlamaFileType.MOSTLY_Q5_0}


def sidecar_path(model_path: str | Path) -> Path:
    p = Path(model_path)
    return p.with_name(p.stem + ".mtp.gguf")


def write_model(path: str | Path, model: MoEModel, tokenizer_kv: list[tuple],
                metadata: Mapping[str, Any], qtype=None, name: str = "alphallama-embedded") -> None:
    """The main model GGUF; matrices in qtype (default Q8_0; a type of FILE_TYPES: those the
    `gguf` package quantizes), norms and router F32."""
    from gguf import GGML_QUANT_VERSION, GGUFWriter
    qtype = QT.Q8_0 if qtype is None else qtype
    if qtype not in FILE_TYPES:
        raise ValueError(f"the export writes {', '.join(t.name for t in FILE_TYPES)}, not {QT(qtype).name}")
    c = model.cfg
    tensors = model.gguf_tensors()
    want = expected_tensors(c.model_config())
    if set(tensors) != set(want) or any(tuple(tensors[k].shape) != s for k, s in want.items()):
        raise ValueError("the training model's tensors do not match what qwen3moe expects")
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    w = GGUFWriter(str(partial), "qwen3moe")
    w.add_type("model")
    w.add_name(name)
    w.add_block_count(c.n_layers)
    w.add_context_length(c.ctx_len)
    w.add_embedding_length(c.d_model)
    w.add_feed_forward_length(c.d_ff_expert)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_rope_freq_base(c.rope_base)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_expert_count(c.n_experts)
    w.add_expert_used_count(c.n_experts_used)
    w.add_expert_feed_forward_length(c.d_ff_expert)
    w.add_file_type(int(FILE_TYPES[qtype]))
    w.add_quantization_version(GGML_QUANT_VERSION)
    for key, value, vtype, sub in tokenizer_kv:
        w.add_key_value(key, value, vtype, sub)
    add_metadata(w, metadata)
    for name_ in want:   # expected_tensors' order: embedding, blocks, output norm
        t = tensors[name_]
        # the router stays F32 as llama.cpp's converters keep it
        add_gguf_tensor(w, name_, t, QT.F32 if name_.endswith("ffn_gate_inp.weight") else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    partial.replace(path)


def export(out_dir: str | Path, stem: str, model: MoEModel, head: MTPHead, tokenizer_kv: list[tuple],
           metadata: Mapping[str, Any], qtype=None) -> tuple[Path, Path]:
    """Write `<stem>.gguf` and `<stem>.mtp.gguf` into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    main = out_dir / f"{stem}.gguf"
    write_model(main, model, tokenizer_kv, metadata, qtype)
    side = sidecar_path(main)
    write_sidecar(side, head, arch="qwen3moe", n_layers=model.cfg.n_layers, ctx_len=model.cfg.ctx_len,
                  metadata=metadata, qtype=qtype)
    return main, side
