"""Synthetic models: seeded random weights in llama.cpp-compatible GGUF files.

Any architecture of `arch.ARCHS`, any shape, any quant type per tensor group. The
tensor list is `arch.expected_tensors` (the tensors llama.cpp loads, nothing else);
metadata keys are the ones llama.cpp's convert_hf_to_gguf writes. The tokenizer is
copied from a vocab GGUF (every `tokenizer.*` key) or, with no source, a trivial
byte-level BPE vocabulary, so the product can make models without shared data.

The parts live beside this module: `synth_spec` (the spec, quant mixes, presets),
`synth_vocab` (the vocabulary), `synth_plan` (the tensor list and each tensor's seeded
values). This one writes the file, tensor by tensor (header and tensor table first), so
an 18.6 GB Qwen3-30B-A3B-shaped file never needs more than one tensor in RAM; every
name of the parts that callers use is importable from here.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGML_QUANT_VERSION, GGUFWriter, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES
from tqdm import tqdm

from .arch import ARCHS
# re-exported: callers import the whole synthetic-model API from alphallama.gguf.writer
from .synth_plan import BIAS_STD, NORM_NOISE, PlannedTensor, model_config, plan_tensors, tensor_data
from .synth_spec import (FILE_TYPE_OF, MIXES, PRESETS, QUANT_GROUPS, SyntheticSpec, q4_k_m_mix, uniform_mix,
                         with_quant)
from .synth_vocab import BYTE_VOCAB_MIN, byte_vocab, vocab_of

__all__ = ["BIAS_STD", "BYTE_VOCAB_MIN", "MIXES", "NORM_NOISE", "PRESETS", "QUANT_GROUPS", "PlannedTensor",
           "SyntheticSpec", "add_arguments", "byte_vocab", "model_config", "plan_tensors", "q4_k_m_mix",
           "run", "tensor_data", "uniform_mix", "with_quant", "write_mtp_sidecar", "write_synthetic"]


# --- writing ----------------------------------------------------------------------

def _file_type(spec: SyntheticSpec, plan: list[PlannedTensor]) -> int:
    if spec.file_type is not None:
        return spec.file_type
    weight = {}
    for t in plan:
        weight[t.qtype] = weight.get(t.qtype, 0) + math.prod(t.shape)
    return int(FILE_TYPE_OF.get(max(weight, key=weight.get), LlamaFileType.GUESSED))


# convert_hf_to_gguf's LlamaModel adds these two keys; its Qwen models leave them out
_WRITES_VOCAB_SIZE_AND_ROPE_DIMS = frozenset({"llama"})


def _add_model_metadata(w: GGUFWriter, spec: SyntheticSpec, n_vocab: int, file_type: int,
                        sidecar: bool = False) -> None:
    """The keys convert_hf_to_gguf writes for these architectures (a sidecar's
    feed_forward_length is its MTP block's dense width, docs/MTP.md)."""
    w.add_type("model")
    w.add_name(spec.name)
    w.add_block_count(spec.n_layers + (1 if spec.mtp or sidecar else 0))
    if spec.mtp or sidecar:
        w.add_nextn_predict_layers(1)
    w.add_context_length(spec.ctx_len)
    w.add_embedding_length(spec.d_model)
    w.add_feed_forward_length((spec.mtp_d_ff or spec.d_ff) if sidecar else spec.d_ff)
    w.add_head_count(spec.n_heads)
    w.add_head_count_kv(spec.n_kv_heads)
    w.add_rope_freq_base(spec.rope_base)
    w.add_layer_norm_rms_eps(spec.norm_eps)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    if ARCHS[spec.arch].moe:
        w.add_expert_count(spec.n_experts)
        w.add_expert_used_count(spec.n_experts_used)
        w.add_expert_feed_forward_length(spec.d_ff_expert)
    if spec.arch in _WRITES_VOCAB_SIZE_AND_ROPE_DIMS:
        w.add_vocab_size(n_vocab)
        w.add_rope_dimension_count(spec.head_dim)
    spec.add_metadata(w)
    for key, value in spec.extra_md.items():
        _add_typed(w, f"{spec.arch}.{key}", value)
    w.add_file_type(file_type)
    w.add_quantization_version(GGML_QUANT_VERSION)


# python type -> the writer's typed adder (floats as float32, ints as uint32, as the converter does)
_TYPED = {bool: GGUFWriter.add_bool, int: GGUFWriter.add_uint32, float: GGUFWriter.add_float32,
          str: GGUFWriter.add_string, list: GGUFWriter.add_array}


def _add_typed(w: GGUFWriter, key: str, value: Any) -> None:
    if type(value) not in _TYPED:
        raise ValueError(f"metadata {key}: cannot write a {type(value).__name__}")
    _TYPED[type(value)](w, key, value)


def write_synthetic(spec: SyntheticSpec, path: str | Path,
                    progress: Callable[[PlannedTensor], None] | None = None, sidecar: bool = False) -> None:
    """Write the model of `spec` to `path`, one tensor at a time; `progress` is called
    after each tensor is written. The file appears under `path` only once complete (an
    interrupted 18 GB write leaves no truncated model behind). sidecar: write only the
    MTP head of `spec` (no vocabulary), as `write_mtp_sidecar` does."""
    vocab, n_vocab = vocab_of(spec)
    plan = plan_tensors(spec, n_vocab, sidecar)
    vocab = [] if sidecar else vocab
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    w = GGUFWriter(str(partial), spec.arch)
    done = False
    try:
        _add_model_metadata(w, spec, n_vocab, _file_type(spec, plan), sidecar)
        for kv in vocab:
            w.add_key_value(kv.key, kv.value, kv.vtype, kv.sub_type)
        for t in plan:   # a uint8 byte shape plus raw_dtype: the writer derives the element shape
            block, type_size = GGML_QUANT_SIZES[t.qtype]
            byte_shape = (*t.shape[:-1], t.shape[-1] // block * type_size)
            w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes, raw_dtype=t.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in plan:
            w.write_tensor_data(tensor_data(spec, t))
            if progress is not None:
                progress(t)
        done = True
    finally:
        w.close()
        if done:
            os.replace(partial, path)
        else:
            partial.unlink(missing_ok=True)


def write_mtp_sidecar(spec: SyntheticSpec, path: str | Path) -> None:
    """The MTP head of `spec` (its `mtp` FFN kind, "dense" if unset) as a sidecar GGUF
    (docs/MTP.md). Tensors are seeded by name, so with the same spec the head equals the
    in-file head that `write_synthetic` writes when `spec.mtp` is set."""
    write_synthetic(replace(spec, mtp=spec.mtp or "dense"), path, sidecar=True)


# --- command line (wired into cli.py as `alphallama synth`) ----------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS), help="model shape")
    parser.add_argument("-o", "--output", required=True, help="GGUF file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers")
    parser.add_argument("--quant", default=None,
                        help=f"a mix ({', '.join(MIXES)}) or one type for every matrix (F16, Q8_0, "
                             f"Q4_K, ...); default: the preset's")
    parser.add_argument("--vocab-from", default=None,
                        help="copy the tokenizer of this GGUF (default: a generated byte-level vocab)")


def run(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {"seed": args.seed}
    if args.layers is not None:
        overrides["n_layers"] = args.layers
    if args.vocab_from is not None:
        overrides["vocab_from"] = args.vocab_from
    if args.quant is not None:
        overrides["quant"] = args.quant
    try:
        spec = PRESETS[args.preset](**overrides)
        n_vocab = vocab_of(spec)[1]
        total = sum(t.nbytes for t in plan_tensors(spec, n_vocab))
        with tqdm(total=total, unit="B", unit_scale=True, desc=Path(args.output).name,
                  disable=not sys.stderr.isatty()) as bar:
            write_synthetic(spec, args.output, progress=lambda t: bar.update(t.nbytes))
    except (ValueError, OSError) as e:
        print(f"alphallama synth: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {spec.arch}, {spec.n_layers} layers, vocab {n_vocab}, "
          f"{total / 2**30:.2f} GiB of tensors")
    return 0
