"""`alphallama inspect`: what a GGUF file holds, read from its header only."""
from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None, help="GGUF file (default: the embedded model)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def tensor_groups(tensors) -> dict[str, dict]:
    """Tensors grouped by name with the layer index removed: count, bytes, params, quant types."""
    groups: dict[str, dict] = defaultdict(lambda: {"count": 0, "bytes": 0, "params": 0, "types": set()})
    for t in tensors.values():
        g = groups[re.sub(r"^blk\.\d+\.", "blk.*.", t.name)]
        g["count"] += 1
        g["bytes"] += t.nbytes
        n = 1
        for d in t.shape:
            n *= d
        g["params"] += n
        g["types"].add(t.qtype.name)
    return {k: {**v, "types": sorted(v["types"])} for k, v in sorted(groups.items())}


_PROVENANCE = "alphallama.training."


def describe(path: str) -> dict:
    from dataclasses import asdict

    from .gguf.arch import load_config
    from .gguf.arch_variants import gpu_departures
    from .gguf.reader import GGUFError, GGUFFile
    f = GGUFFile(path)   # the header itself must be valid; the model may still be one we cannot run
    md = f.metadata
    try:
        cfg, unsupported = load_config(f), None
    except GGUFError as e:
        cfg, unsupported = None, str(e)
    groups = tensor_groups(f.tensors)
    total = sum(g["bytes"] for g in groups.values())
    template = md.get("tokenizer.chat_template")
    return {
        "path": path, "file_bytes": f.file_size, "name": md.get("general.name"),
        "architecture": md.get("general.architecture"),
        "config": asdict(cfg) if cfg is not None else None,
        "unsupported": unsupported,      # why the engine cannot run this file (None: it can)
        "gpu_unsupported": gpu_departures(cfg) if cfg is not None else None,
        # the architecture's own keys as the file has them (arrays by their length)
        "hyperparameters": {k: (f"[{len(v)} values]" if isinstance(v, list) else v) for k, v in md.items()
                            if k.startswith(f"{md.get('general.architecture')}.")},
        "params": sum(g["params"] for g in groups.values()), "tensor_bytes": total,
        "groups": groups,
        "types": _types(f.tensors),
        "tokenizer": {"model": md.get("tokenizer.ggml.model"), "pre": md.get("tokenizer.ggml.pre"),
                      "tokens": len(md.get("tokenizer.ggml.tokens") or []),
                      "merges": len(md.get("tokenizer.ggml.merges") or []),
                      "bos": md.get("tokenizer.ggml.bos_token_id"), "eos": md.get("tokenizer.ggml.eos_token_id"),
                      "add_bos": md.get("tokenizer.ggml.add_bos_token")},
        "chat_template": template,
        # where a model trained by `python -m alphallama.train` came from
        "provenance": {k[len(_PROVENANCE):]: v for k, v in md.items() if k.startswith(_PROVENANCE)},
        "mtp_head": _mtp_head(f, cfg) if cfg is not None else None,
    }


def _types(tensors) -> dict:
    """Per tensor type: count, bytes, and which runtimes compute it (offload/support.py)."""
    from .offload.support import type_uses
    return {q: u.to_dict() for q, u in type_uses(tensors).items()}


def _mtp_head(f, cfg) -> dict | None:
    """The MTP head the engine would use (in the file, or `<stem>.mtp.gguf` beside it); a
    head that is there but wrong is reported, not raised: inspect describes, it does not load."""
    from .gguf.arch import find_mtp_head
    from .gguf.reader import GGUFError
    try:
        found = find_mtp_head(f, cfg)
    except GGUFError as e:
        return {"error": str(e)}
    if found is None:
        return None
    _, hc = found
    return {"path": hc.path, "sidecar": hc.sidecar, "layer": hc.layer,
            "ffn": "moe" if hc.moe else f"dense {hc.d_ff}"}


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _print_config(d: dict, c: dict) -> None:
    print(f"architecture {c['arch']}: {c['n_layers']} layers, d_model {c['d_model']}, "
          f"{c['n_heads']} heads / {c['n_kv_heads']} kv heads of {c['head_dim']}, ffn {c['d_ff']}, "
          f"vocab {c['vocab_size']}, context {c['ctx_len']}")
    if c["n_experts"]:
        print(f"experts: {c['n_experts']} ({c['n_experts_used']} used per token), expert ffn {c['d_ff_expert']}")
    print(f"rope: base {c['rope_base']:g}, {c['rope_dim']} dims, {'neox halves' if c['rope_neox'] else 'adjacent pairs'}"
          + _rope_scaling(c["variant"]))
    v = c["variant"]
    if v["sliding_window"]:
        n_swa = sum(v["swa_layers"])
        print(f"sliding window: {v['sliding_window']} on {n_swa} of {c['n_layers']} layers "
              f"(their rope base {v['rope_base_swa']:g})")
    gpu = d["gpu_unsupported"]
    print("GPU runtime: supported" if not gpu else f"GPU runtime: not yet ({', '.join(gpu)}); CPU only")


def _rope_scaling(v: dict) -> str:
    r = v["rope"]
    out = "" if r["kind"] == "none" else f", {r['kind']} scaling x{r['factor']:g} (original context {r['orig_ctx']})"
    return out + (f", frequency factors {', '.join(v['rope_factors'])}" if v["rope_factors"] else "")


def run(args) -> int:
    from .cli_run import resolve_model
    d = describe(resolve_model(args.model))
    if args.json:
        print(json.dumps(d, indent=1))
        return 0
    c = d["config"]
    print(f"{d['path']}: {d['name']}  ({_mib(d['file_bytes'])})")
    if c is None:
        print(f"architecture {d['architecture']}: unsupported: {d['unsupported']}")
        for key, value in d["hyperparameters"].items():
            print(f"  {key:44} {value}")
    else:
        _print_config(d, c)
    print(f"parameters {d['params']:,} in {_mib(d['tensor_bytes'])}")
    print(f"{'tensor group':28} {'n':>4} {'size':>14} {'types'}")
    for name, g in d["groups"].items():
        print(f"{name:28} {g['count']:>4} {_mib(g['bytes']):>14} {','.join(g['types'])}")
    for q, u in d["types"].items():
        why = u["cpu_refusal"] or u["gpu_refusal"]
        print(f"type {q:10} {u['count']:>5} tensors {_mib(u['bytes']):>14} {u['runs_on']}"
              + (f": {why}" if why else ""))
    t = d["tokenizer"]
    print(f"tokenizer: {t['model']} (pre {t['pre']}), {t['tokens']} tokens, {t['merges']} merges, "
          f"bos {t['bos']} eos {t['eos']} add_bos {t['add_bos']}")
    tmpl = d["chat_template"]
    print(f"chat template: {len(tmpl)} chars" if tmpl else "chat template: none")
    head = d["mtp_head"]
    if head is None:
        print("MTP head: none")
    elif "error" in head:
        print(f"MTP head: unusable: {head['error']}")
    else:
        where = "sidecar " + head["path"] if head["sidecar"] else "in the file"
        print(f"MTP head: block {head['layer']}, {head['ffn']} FFN, {where}")
    for key, value in d["provenance"].items():
        print(f"trained: {key:24} {value}")
    return 0
