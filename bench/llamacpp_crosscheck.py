"""Cross-check of the llama.cpp reference (qwen2.5-coder-0.5b-instruct) against llama.cpp itself,
run under several configurations on THIS machine.

Question: the reference file (made by llama.cpp, CPU build, 2 threads, on an unknown machine) picks
token 686 over 2038 at generated position 60 of the "Rename the function `add` ..." case with a
logprob gap of 0.063. Is that choice stable across llama.cpp configurations here?

For every setting and every reference case this feeds exactly `prompt_ids` (token ids, no
re-tokenization), decodes 64 tokens (prompt in chunks of n_batch, then one token per llama_decode, as
llama-server does) and records the greedy ids and the first position where they differ from the
reference `gen_ids`. Each case is decoded teacher-forced along the reference tokens (identical to
the greedy run up to its first divergence; the greedy continuation after a divergence is decoded
separately), so per-position numbers (logprobs of 686/2038 at "Rename" position 60, mean |logprob
difference| of the reference's top-2 ids vs the reference `top5`) are always taken along the
reference sequence. Log-softmax is computed in float64 from llama.cpp's float32 logits.

Run (llama-cpp-python is NOT a dependency of alphallama; it lives in a separate venv; this script
does not import alphallama):

    /tmp/lcpenv/bin/python bench/llamacpp_crosscheck.py \
        [--model ~/.cache/alphallama/models/qwen2.5-coder-0.5b-instruct.gguf] \
        [--reference /work/shared/data/reference/qwen2.5-coder-0.5b-instruct.json] \
        [--out bench/results/llamacpp-crosscheck-qwen2.5-coder-0.5b-YYYYMMDD.json] \
        [--only NAME[,NAME...]] [--resume]

The JSON is rewritten after every setting; --resume keeps the settings already in it.

Each setting runs in its own child process (the AMX weight path segfaults on this machine for
batched prompts; a crash is recorded, not fatal).

Weight paths ("weights" in a setting):
  plain  use_extra_bufts=False: every weight in the ordinary CPU buffer (ggml vec_dot / llamafile
         sgemm kernels).
  repack use_extra_bufts=True with the AMX buffer type taken out of the CPU device's extra
         buffer-type list (patched in memory before the model loads), so llama.cpp's own
         selection puts weights in CPU_REPACK where it can (here: the q4_K ffn_down tensors,
         repacked to q4_K_8x8). This is what default llama.cpp does on an x86 CPU without AMX.
  amx    use_extra_bufts=True unmodified (default llama.cpp on this AMX machine): AMX, then
         CPU_REPACK. It segfaults in ggml_backend_amx_mul_mat once a batch has more than one
         token, so only n_batch=1 can run.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

DEFAULT_MODEL = "~/.cache/alphallama/models/qwen2.5-coder-0.5b-instruct.gguf"
DEFAULT_REF = "/work/shared/data/reference/qwen2.5-coder-0.5b-instruct.json"
N_GEN = 64
WATCH_POS, WATCH_IDS = 60, (686, 2038)   # "Rename" case: reference picks 686, exact math 2038

# flash_attn: -1 auto (llama-server default; resolves to enabled on CPU), 0 off, 1 on.
# kv: ggml type of K and V cache (1 = f16, llama.cpp default; 0 = f32).
S = lambda name, weights, threads=2, fa=-1, kv="f16", n_batch=512: dict(
    name=name, weights=weights, n_threads=threads, flash_attn=fa, kv=kv, n_batch=n_batch)
SETTINGS = [
    S("repack_t2_faauto_f16_b512", "repack"),          # llama-server defaults on a non-AMX x86 CPU
    S("repack_t2_faoff_f16_b512", "repack", fa=0),
    S("repack_t2_faauto_f32_b512", "repack", kv="f32"),  # identical to f16 cache under FA
    S("repack_t2_faoff_f32_b512", "repack", fa=0, kv="f32"),
    S("repack_t2_faauto_f16_b1", "repack", n_batch=1),
    S("repack_t1_faauto_f16_b512", "repack", threads=1),
    S("plain_t2_faauto_f16_b512", "plain"),
    S("plain_t2_faoff_f16_b512", "plain", fa=0),
    S("plain_t2_faauto_f16_b1", "plain", n_batch=1),
    S("amx_t2_faauto_f16_b1", "amx", n_batch=1),
    S("amx_t2_faauto_f16_b512", "amx"),                 # segfaults here (recorded as failed)
]


# ----------------------------------------------------------------------------------------- worker

def _extra_bufts_list(L):
    """The CPU device's null-terminated extra buffer-type array that llama.cpp reads at model load."""
    libdir = os.path.join(os.path.dirname(L.__file__), "lib")
    g = ctypes.CDLL(os.path.join(libdir, "libggml.so"))
    g.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    g.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    g.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    g.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    g.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    g.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    g.ggml_backend_buft_name.restype = ctypes.c_char_p
    g.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    dev = g.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    fp = g.ggml_backend_reg_get_proc_address(g.ggml_backend_dev_backend_reg(dev), b"ggml_backend_dev_get_extra_bufts")
    arr = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fp)(dev)
    entries = []
    while arr[len(entries)]:
        entries.append(arr[len(entries)])
    return arr, entries, (lambda p: g.ggml_backend_buft_name(p).decode())


def worker(setting: dict, model_path: str, ref_path: str) -> dict:
    import llama_cpp as L  # noqa: F401  (fail early, before the workers, if llama-cpp-python is missing)

    L.llama_backend_init()
    ref = json.load(open(ref_path))
    arr, entries, bname = _extra_bufts_list(L)
    info = {"extra_bufts_available": [bname(p) for p in entries]}
    if setting["weights"] == "repack":
        keep = [p for p in entries if bname(p) != "AMX"]
        for i, p in enumerate(keep):
            arr[i] = p
        arr[len(keep)] = None
        info["extra_bufts_used"] = [bname(p) for p in keep]
    elif setting["weights"] == "amx":
        info["extra_bufts_used"] = [bname(p) for p in entries]
    else:
        info["extra_bufts_used"] = []

    mp = L.llama_model_default_params()
    mp.use_extra_bufts = setting["weights"] != "plain"
    model = L.llama_model_load_from_file(os.path.expanduser(model_path).encode(), mp)
    assert model, "model load failed"
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)

    cp = L.llama_context_default_params()
    nb = setting["n_batch"]
    cp.n_ctx = 4096
    cp.n_batch = nb
    cp.n_ubatch = nb
    cp.n_threads = cp.n_threads_batch = setting["n_threads"]
    cp.flash_attn_type = setting["flash_attn"]
    cp.type_k = cp.type_v = {"f16": L.GGML_TYPE_F16, "f32": L.GGML_TYPE_F32}[setting["kv"]]
    ctx = L.llama_init_from_model(model, cp)
    assert ctx, "context init failed"
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(max(nb, 1), 0, 1)

    def decode(tokens, pos0, want_last):
        for c0 in range(0, len(tokens), nb):
            chunk = tokens[c0:c0 + nb]
            for j, t in enumerate(chunk):
                batch.token[j] = t
                batch.pos[j] = pos0 + c0 + j
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = 0
                batch.logits[j] = int(want_last and c0 + j == len(tokens) - 1)
            batch.n_tokens = len(chunk)
            rc = L.llama_decode(ctx, batch)
            assert rc == 0, f"llama_decode rc={rc}"

    def logprobs():
        lg = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).astype(np.float64)
        m = lg.max()
        return lg - (m + np.log(np.exp(lg - m).sum()))

    def step_rows(lp, k, ref_top5):
        top = np.argpartition(-lp, 5)[:5]
        top = top[np.argsort(-lp[top], kind="stable")]
        keep_ids = set(WATCH_IDS) | {int(t) for t in top} | {int(t) for t, _ in ref_top5[k]}
        return {"argmax": int(np.argmax(lp)), "top5": [[int(t), float(lp[t])] for t in top],
                "lp": {t: float(lp[t]) for t in keep_ids}}

    def teacher_forced(prompt, gen_ref, ref_top5):
        """Prompt, then the reference tokens one per llama_decode; llama.cpp's logprobs at every position."""
        L.llama_memory_clear(mem, True)
        decode(prompt, 0, True)
        rows = []
        for k in range(N_GEN):
            rows.append(step_rows(logprobs(), k, ref_top5))
            if k < N_GEN - 1:
                decode([gen_ref[k]], len(prompt) + k, True)
        return rows

    def continue_greedy(prompt, gen_ref, d, tok_d):
        """Greedy tokens d+1..63 after llama.cpp picked tok_d != reference at position d: the KV entries
        from position len(prompt)+d on (reference tokens) are removed and decoding goes on greedily."""
        ids = [tok_d]
        if d < N_GEN - 1:
            assert L.llama_memory_seq_rm(mem, 0, len(prompt) + d, -1)
        for k in range(d + 1, N_GEN):
            decode([ids[-1]], len(prompt) + k - 1, True)
            ids.append(int(np.argmax(logprobs())))
        return ids

    cases = []
    t0 = time.time()
    for case in ref["cases"]:
        gen_ref = case["gen_ids"]
        forced_rows = teacher_forced(case["prompt_ids"], gen_ref, case["top5"])
        first_diff = next((k for k in range(N_GEN) if forced_rows[k]["argmax"] != gen_ref[k]), None)
        ids = [r["argmax"] for r in forced_rows]
        if first_diff is not None:   # greedy run = forced run up to first_diff; then its own continuation
            ids = ids[:first_diff] + continue_greedy(case["prompt_ids"], gen_ref, first_diff, ids[first_diff])
        # reference top-2 ids vs llama.cpp's logprobs of the same ids, along the reference sequence
        diffs, flips = [], []
        for k, (r, row) in enumerate(zip(case["top5"], forced_rows)):
            for tid, rlp in r[:2]:
                diffs.append(abs(float(row["lp"][tid]) - rlp))
            if row["argmax"] != r[0][0]:
                flips.append({"pos": k, "ref_top1": r[0][0], "ref_gap": round(r[0][1] - r[1][1], 6),
                              "llama_top1": row["argmax"], "llama_top2": row["top5"][:2]})
        rec = {
            "input": case["input"][:60],
            "n_prompt": len(case["prompt_ids"]),
            "gen_ids": ids,
            "first_diff_from_reference": first_diff,
            "matches_reference_64": first_diff is None,
            "top2_abs_logprob_diff_vs_reference": {"mean": float(np.mean(diffs)), "max": float(np.max(diffs)),
                                                   "n": len(diffs)},
            "positions_where_llama_top1_differs_from_reference_top1_teacher_forced": flips,
        }
        if case["input"].startswith("Rename"):
            row = forced_rows[WATCH_POS]
            a, b = (row["lp"][WATCH_IDS[0]], row["lp"][WATCH_IDS[1]])
            rec["watch"] = {
                "pos": WATCH_POS, "teacher_forced_past_divergence": first_diff is not None and first_diff < WATCH_POS,
                f"lp_{WATCH_IDS[0]}": a, f"lp_{WATCH_IDS[1]}": b,
                "lp_686_minus_lp_2038": a - b,
                "llama_pick": WATCH_IDS[0] if a > b else WATCH_IDS[1],
                "llama_top5": row["top5"],
                "reference_top5": case["top5"][WATCH_POS],
            }
            rec["llama_top2_along_reference"] = [r["top5"][:2] for r in forced_rows]
        cases.append(rec)
    info["seconds_cases"] = round(time.time() - t0, 1)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return {**setting, **info, "status": "ok", "cases": cases}


# ------------------------------------------------------------------------------------------ driver

def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cpu_flags() -> list[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma", "f16c")))
    except OSError:
        pass
    return []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--reference", default=DEFAULT_REF)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=None, help="comma-separated setting names")
    ap.add_argument("--resume", action="store_true", help="keep finished settings found in --out")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker), args.model, args.reference)), flush=True)
        return

    import llama_cpp as L  # noqa: F401  (fail early, before the workers, if llama-cpp-python is missing)
    today = datetime.date.today()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"llamacpp-crosscheck-qwen2.5-coder-0.5b-{today:%Y%m%d}.json")
    settings = SETTINGS if not args.only else [s for s in SETTINGS if s["name"] in args.only.split(",")]
    model_path = os.path.expanduser(args.model)
    h = hashlib.sha256()
    with open(model_path, "rb") as f:
        for blk in iter(lambda: f.read(1 << 22), b""):
            h.update(blk)
    ref = json.load(open(args.reference))

    results = []
    if args.resume and os.path.exists(out):   # keep settings already run; re-run selected failed ones
        to_run = {s["name"] for s in settings}
        results = [r for r in json.load(open(out))["settings"] if r["status"] == "ok" or r["name"] not in to_run]
    done = {r["name"] for r in results}
    for s in settings:
        if s["name"] in done:
            continue
        t0 = time.time()
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(s),
                            "--model", model_path, "--reference", args.reference],
                           capture_output=True, text=True, timeout=1200)
        line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line and p.returncode == 0:
            r = json.loads(line[len("RESULT "):])
        else:
            err = [l for l in p.stderr.splitlines() if l.strip()][-3:]
            r = {**s, "status": f"failed (exit code {p.returncode})", "stderr_tail": err}
        r["seconds_total"] = round(time.time() - t0, 1)
        results.append(r)
        if r["status"] == "ok":
            w = next(c["watch"] for c in r["cases"] if "watch" in c)
            print(f"{s['name']:28s} match={[c['first_diff_from_reference'] for c in r['cases']]} "
                  f"pos60 pick={w['llama_pick']} lp686-lp2038={w['lp_686_minus_lp_2038']:+.4f} "
                  f"({r['seconds_total']}s)", flush=True)
        else:
            print(f"{s['name']:28s} {r['status']}", flush=True)
        write_doc(out, args, model_path, h.hexdigest(), ref, results, today)
    print("wrote", out)


def write_doc(out, args, model_path, sha256, ref, results, today) -> None:
    import llama_cpp as L  # noqa: F401  (fail early, before the workers, if llama-cpp-python is missing)
    order = {s["name"]: i for i, s in enumerate(SETTINGS)}
    results = sorted(results, key=lambda r: order.get(r["name"], len(order)))

    ok = [r for r in results if r["status"] == "ok"]
    summary = {
        "reference_watch": {"pos": WATCH_POS, "reference_top2": ref["cases"][[c["input"].startswith("Rename")
                                                                              for c in ref["cases"]].index(True)]["top5"][WATCH_POS][:2]},
        "per_setting": [{
            "name": r["name"],
            "pos60_pick": next(c["watch"]["llama_pick"] for c in r["cases"] if "watch" in c),
            "pos60_lp686_minus_lp2038": next(c["watch"]["lp_686_minus_lp_2038"] for c in r["cases"] if "watch" in c),
            "first_diff_per_case": [c["first_diff_from_reference"] for c in r["cases"]],
            "all_4_cases_match_reference_64": all(c["matches_reference_64"] for c in r["cases"]),
            "rename_top2_mean_abs_lp_diff": next(c["top2_abs_logprob_diff_vs_reference"]["mean"]
                                                 for c in r["cases"] if "watch" in c),
        } for r in ok],
        "failed_settings": [{"name": r["name"], "status": r["status"]} for r in results if r["status"] != "ok"],
    }
    summary["any_setting_reproduces_all_4_cases"] = any(x["all_4_cases_match_reference_64"] for x in summary["per_setting"])
    summary["pos60_picks"] = sorted({x["pos60_pick"] for x in summary["per_setting"]})

    doc = {
        "what": "llama.cpp (via llama-cpp-python) re-run of the qwen2.5-coder-0.5b reference cases under several "
                "configurations on this machine; see bench/llamacpp_crosscheck.py docstring",
        "date": today.isoformat(),
        "datetime_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu_model": cpu_model(), "n_cpus": os.cpu_count(), "cpu_flags_simd": cpu_flags(),
                    "platform": platform.platform()},
        "llama_cpp_python_version": L.__version__,
        "llama_cpp_system_info": L.llama_print_system_info().decode().strip(),
        "python": sys.version.split()[0],
        "model": {"path": model_path, "sha256": sha256, "bytes": os.path.getsize(model_path)},
        "reference": {"path": args.reference, "meta": ref.get("meta")},
        "method": {
            "n_gen": N_GEN, "n_ctx": 4096, "n_ubatch": "= n_batch",
            "prompt": "exact reference prompt_ids, decoded in chunks of n_batch (logits for the last token only), "
                      "then one token per llama_decode",
            "greedy": "argmax of llama.cpp's float32 logits; logprobs = float64 log-softmax of them",
            "teacher_forced": "every case is first run feeding the reference gen_ids one token per llama_decode "
                              "(identical to the greedy run up to its first divergence); all per-position "
                              "statistics come from that run. Where llama.cpp's argmax differs from the "
                              "reference at position d, the greedy gen_ids after d come from removing the "
                              "KV entries from d on (llama_memory_seq_rm) and decoding greedily from its own pick",
            "top2_abs_logprob_diff": "for each of the 64 positions, the reference's top-2 ids: "
                                     "|llama.cpp logprob - reference logprob|, mean/max over 128 values",
            "flash_attn": "-1 auto (llama-server default; resolves to enabled on CPU), 0 off, 1 on",
            "kv_f32_with_flash_attn": "with flash attention on, an f32 K/V cache gave results identical to an f16 "
                                      "cache here (consistent with llama.cpp casting K/V to f16 for the "
                                      "flash-attention op); f32 vs f16 only differs with flash_attn off",
            "checks": "during development, for repack_t2_faauto_f16_b512: two runs gave identical numbers, and "
                      "the seq_rm continuation gave the same greedy gen_ids as a from-scratch greedy run",
            "cpu_contention": "the 2 cores were shared with other jobs (load average 4-6), so seconds_* are "
                              "not speed measurements",
        },
        "settings": results,
        "summary": summary,
    }
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
