"""The whole run: corpus -> instruction examples -> tokenizer -> token streams -> training
-> export (+ parts and checksums) -> train.json. Each stage's output is kept in the work
folder, so a second call on the same machine skips to training and resumes it.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import pickle
import random
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from ..private_dir import private_dir
from .bpe import gguf_tokenizer_kv, train_bpe
from .corpus import SourceFile, collect, default_roots, write_manifest
from .data import rendered_examples, tokenize_docs
from .export import export
from .init_from import Start, read_start
from .instruct import TEACHER_KIND, chat_template_text
from .loop import Hyper, train
from .model import MoEConfig, MoEModel
from .mtp import MTPConfig, MTPHead
from .parts import sha256_file, split_file
from .teach_answers import answers_record, read_answers
from .unlikely import Unlikely


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _share(text: str) -> float:
    x = float(text)
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"a share is between 0 and 1, not {text}")
    return x


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"a count of at least 1, not {text}")
    return n


def _roots(args) -> list[tuple[str, Path]]:
    if not args.root:
        return default_roots()
    out = []
    for r in args.root:
        label, _, path = r.partition("=")
        out.append((label, Path(path)))
    return out


def corpus_files(args) -> list[SourceFile]:
    """The corpus of `--root` (default: this interpreter's) up to `--corpus-mb`, held-out
    files marked (corpus.collect); train/teach.py asks its requests of the same files."""
    return collect(_roots(args), max_bytes=args.corpus_mb << 20)


def example_texts(texts: list[str]) -> list[str]:
    """The training texts examples are made from: each one parses its file, and big files
    would make that the slow part of the run."""
    return [x for x in texts if len(x) <= 32_000] or texts


def data_key(args) -> dict:
    """What the data stage depends on: its arguments and the teacher answers' sha256."""
    key = {k: getattr(args, k) for k in ("corpus_mb", "instruct_examples", "write_function_weight",
                                         "vocab_size", "seed", "root", "tokenizer_sample_mb")}
    answers = getattr(args, "teacher_answers", None)
    key["teacher_answers_sha256"] = sha256_file(answers) if answers else None
    key["teacher_share"] = getattr(args, "teacher_share", None)
    key["teacher_repeat"] = getattr(args, "teacher_repeat", 1)
    init = getattr(args, "init_from", None)
    key["init_from_sha256"] = sha256_file(init) if init else None   # its tokenizer replaces the BPE's
    return key


def build_data(args, work: Path, timings: dict, start: Start | None = None) -> dict:
    """Corpus, examples, tokenizer (start's, else trained) and token streams; cached in
    work/data.pt."""
    key = data_key(args)
    cache = work / "data.pt"
    d = load_data_cache(cache, key)
    if d is not None:
        _log("data: reusing the work folder's corpus, tokenizer and token streams")
        return d
    t = time.time()
    files = corpus_files(args)
    train_f = [f for f in files if not f.held_out]
    held = [f for f in files if f.held_out]
    manifest_sha = write_manifest(files, work / "manifest.tsv.gz")
    with gzip.open(work / "heldout.jsonl.gz", "wt") as fh:
        for f in held:
            fh.write(json.dumps({"path": f.path, "sha256": f.sha256, "text": f.text}) + "\n")
    timings["corpus_s"] = time.time() - t
    _log(f"corpus: {len(files)} files ({sum(f.size for f in files) / 2**20:.0f} MiB), "
         f"{len(held)} held out; manifest {manifest_sha[:12]}")
    t = time.time()
    texts = [f.text for f in train_f]
    answers = read_answers(args.teacher_answers) if args.teacher_answers else []
    n_answers = len(answers)
    answers = answers * args.teacher_repeat         # each answer that many examples (its own system prompt draw)
    examples = rendered_examples(example_texts(texts), args.instruct_examples, args.seed, workers=args.workers,
                                 weights={"write_function": args.write_function_weight},
                                 teacher=answers, teacher_share=args.teacher_share)
    kinds = dict(Counter(k for k, _ in examples))
    teacher = (answers_record(args.teacher_answers, n_answers, kinds.get(TEACHER_KIND, 0), args.teacher_share,
                              args.teacher_repeat)
               if args.teacher_answers else None)
    timings["examples_s"] = time.time() - t
    _log(f"examples: {len(examples)} ({kinds})" + (f"; teacher examples {teacher['used']} of {n_answers} answers "
                                                     f"x {args.teacher_repeat} ({teacher['file']})" if teacher else ""))
    t = time.time()
    rng = random.Random(args.seed)
    if start is not None:
        hf = start.tokenizer
        _log(f"tokenizer: {hf.get_vocab_size()} tokens, {start.path}'s")
    else:
        hf = trained_tokenizer(args, texts, examples, rng)
    timings["bpe_s"] = time.time() - t
    t = time.time()
    docs = texts + [e for _, e in examples]
    rng.shuffle(docs)
    eot = hf.token_to_id("<|endoftext|>")
    train_ids = tokenize_docs(hf, docs, eot)
    val_ids = tokenize_docs(hf, [f.text for f in held], eot)
    timings["tokenize_s"] = time.time() - t
    n_code = int(sum(len(x) for x in texts))
    _log(f"tokens: {len(train_ids) / 1e6:.1f}M train, {len(val_ids) / 1e6:.2f}M held out "
         f"({n_code / max(1, len(train_ids)):.2f} chars/token overall)")
    d = {"key": key, "train": train_ids, "val": val_ids, "tokenizer": hf.to_str(), "manifest_sha": manifest_sha,
         "corpus": {"files": len(files), "bytes": sum(f.size for f in files), "held_out_files": len(held),
                    "held_out_bytes": sum(f.size for f in held), "manifest_sha256": manifest_sha,
                    "examples": kinds, "teacher": teacher,
                    "tokens_train": int(len(train_ids)), "tokens_val": int(len(val_ids))}}
    save_data_cache(d, cache)
    return d


def trained_tokenizer(args, texts: list[str], examples: list[tuple[str, str]], rng: random.Random):
    """A BPE trained on --tokenizer-sample-mb of the texts in rng's order and 3,000 examples."""
    sample, size = [], 0
    for x in rng.sample(texts, len(texts)):
        if size > args.tokenizer_sample_mb << 20:
            break
        sample.append(x)
        size += len(x)
    hf = train_bpe(sample + [e for _, e in examples[:3000]], args.vocab_size)
    _log(f"tokenizer: {hf.get_vocab_size()} tokens from {size / 2**20:.0f} MiB")
    return hf


def save_data_cache(d: dict, cache: Path) -> None:
    """The data stage's output as plain values and tensors only (so it loads with
    weights_only=True), by an atomic rename."""
    tmp = cache.with_name(cache.name + ".partial")
    torch.save({**d, "train": torch.from_numpy(d["train"]), "val": torch.from_numpy(d["val"])}, tmp)
    tmp.replace(cache)


def load_data_cache(cache: Path, key: dict) -> dict | None:
    """The cached data stage if it was made with these arguments. weights_only=True: the
    file is never unpickled into arbitrary objects, so a planted or old-format cache is
    a miss (rebuilt), not code run."""
    if not cache.exists():
        return None
    try:
        d = torch.load(cache, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        _log(f"data: ignoring {cache} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        return None
    if not isinstance(d, dict) or d.get("key") != key:
        return None
    return {**d, "train": d["train"].numpy(), "val": d["val"].numpy()}


def run(args) -> int:
    t_start = time.time()
    deadline = t_start + args.deadline_s - args.export_reserve_s if args.deadline_s else None
    work, out = private_dir(Path(args.work_dir).expanduser()), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    timings: dict = {}
    start = read_start(args.init_from) if args.init_from else None
    d = build_data(args, work, timings, start)
    from tokenizers import Tokenizer as HFTokenizer
    hf = HFTokenizer.from_str(d["tokenizer"])
    torch.manual_seed(args.seed)
    if start is not None:   # the model's own shape; its weights, unless a checkpoint resumes below
        cfg, mtp_ffn = start.cfg, start.mtp_d_ff
        _log(f"model: continued from {start.path} (sha256 {start.sha256[:12]}); the shape flags are its")
    else:
        cfg = MoEConfig(vocab_size=hf.get_vocab_size(), d_model=args.d_model, n_layers=args.layers,
                        n_heads=args.heads, n_kv_heads=args.kv_heads, head_dim=args.head_dim,
                        n_experts=args.experts, n_experts_used=args.experts_used, d_ff_expert=args.expert_ffn,
                        ctx_len=args.ctx)
        mtp_ffn = args.mtp_ffn
    model = MoEModel(cfg)
    head = MTPHead(MTPConfig.from_model(cfg.model_config(), mtp_ffn))
    if start is not None:
        start.load_into(model, head)
    n_params = sum(p.numel() for p in model.parameters())
    _log(f"model: {n_params / 1e6:.1f}M params (+{sum(p.numel() for p in head.parameters()) / 1e6:.1f}M MTP) "
         f"on {device}")
    hp = Hyper(batch_size=args.batch_size, ctx_len=args.ctx, lr=args.lr, warmup_steps=args.warmup_steps,
               time_budget_s=args.time_budget_s, mtp_depths=args.mtp_depths, mtp_weight=args.mtp_weight,
               aux_weight=args.aux_weight, checkpoint_every_s=args.checkpoint_every_s, seed=args.seed,
               max_steps=args.max_steps, log_every=args.log_every, ce_chunk=args.ce_chunk, mtp_frac=args.mtp_frac,
               unlikely=Unlikely(weight=args.unlikelihood, every=args.unlikelihood_every,
                                 batch=args.unlikelihood_batch, ngram=args.unlikelihood_ngram),
               anchor=args.anchor)
    eot = hf.token_to_id("<|endoftext|>")
    stops = tuple(i for i in (eot, hf.token_to_id("<|im_end|>")) if i is not None)
    t = time.time()
    try:
        st = train(model, head, torch.from_numpy(d["train"].astype(np.int32)),
                   torch.from_numpy(d["val"].astype(np.int32)), hp, device, work / "ckpt.pt", deadline, _log,
                   continue_later=args.continue_later, eot=eot, stop_ids=stops)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:   # export what the checkpoint holds
        _log(f"training failed: {type(e).__name__}: {e}")
        from .loop import State, load
        st = load(work / "ckpt.pt", model, head, torch.optim.AdamW(
            [p for m in (model, head) for p in m.parameters()])) or State()
    timings["train_wall_s"] = time.time() - t
    t = time.time()
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    command = args.command or "python -m alphallama.train " + shlex.join(sys.argv[1:])
    meta = {"alphallama.training.command": command, "alphallama.training.date": date,
            "alphallama.training.corpus_manifest_sha256": d["manifest_sha"],
            "alphallama.training.steps": st.step, "alphallama.training.tokens": st.tokens,
            "alphallama.training.seconds": round(st.trained_s, 1), "alphallama.training.device": gpu,
            "alphallama.training.commit": args.commit or "unknown"} | teacher_meta(d["corpus"].get("teacher"))
    if start is not None:
        meta |= {"alphallama.training.init_from": os.path.basename(start.path),
                 "alphallama.training.init_from_sha256": start.sha256}
    from gguf import GGMLQuantizationType as QT
    main, side = export(out, args.stem, model.cpu().float(), head.cpu().float(),
                        gguf_tokenizer_kv(hf, chat_template_text()), meta, QT[args.quant])
    for name in ("manifest.tsv.gz", "heldout.jsonl.gz"):
        (out / name).write_bytes((work / name).read_bytes())
    sums = {p.name: sha256_file(p) for p in (main, side)}
    part_bytes = int(args.split_mib * 2**20)
    for p in (main, side):   # NAME.partNN + NAME.sha256 (parts.py) for what is too big to come back whole
        if part_bytes and p.stat().st_size > part_bytes:
            split_file(p, out, part_bytes)
            p.unlink()
    timings["export_s"] = time.time() - t
    report = {"date": date, "command": command, "commit": args.commit, "device": gpu,
              "torch": torch.__version__, "config": asdict(cfg), "mtp_d_ff": mtp_ffn,
              "params": n_params, "hyper": asdict(hp), "init_from": start.record() if start else None,
              "corpus": d["corpus"], "timings": timings,
              "state": {"step": st.step, "trained_s": st.trained_s, "tokens": st.tokens},
              "teacher": d["corpus"].get("teacher"), "curves": st.curves, "files": sums}
    (out / "train.json").write_text(json.dumps(report, indent=1))
    last = st.curves["val"][-1] if st.curves["val"] else {}
    _log(f"done: {st.step} steps, {st.tokens / 1e6:.1f}M tokens, {st.trained_s:.0f} s; held-out loss "
         f"{last.get('loss', float('nan')):.3f}, MTP " + " ".join(f"{x:.3f}" for x in last.get("mtp", []))
         + " top1 " + " ".join(f"{x:.2f}" for x in last.get("mtp_top1", [])))
    _log(f"files: {', '.join(sorted(p.name for p in out.iterdir()))}; total {time.time() - t_start:.0f} s")
    return 0


def teacher_meta(rec: dict | None) -> dict:
    """The model's alphallama.training.teacher_* keys: how many teacher answers went in, from
    which file (name, sha256) and teacher model (when its summary was beside the file)."""
    if not rec:
        return {}
    meta = {"alphallama.training.teacher_answers": int(rec["used"]),
            "alphallama.training.teacher_answers_file": rec["file"],
            "alphallama.training.teacher_answers_sha256": rec["sha256"]}
    if rec.get("share") is not None:
        meta["alphallama.training.teacher_share"] = float(rec["share"])
    if rec.get("repeat", 1) != 1:
        meta["alphallama.training.teacher_repeat"] = int(rec["repeat"])
    for k in ("teacher", "teacher_sha256"):
        if isinstance(rec.get(k), str):
            meta[f"alphallama.training.{k.replace('teacher', 'teacher_model')}"] = rec[k]
    return meta


def add_arguments(p: argparse.ArgumentParser, T) -> None:
    a = p.add_argument
    a("--out", required=True, help="folder for the GGUF files, train.json, manifest, held-out files")
    a("--work-dir", default=T.work_dir, help="corpus/token cache and checkpoint, a directory only you can enter "
                                                    "(created 0700; a second call resumes)")
    a("--stem", default="alphallama-embedded", help="model file name without .gguf")
    a("--root", action="append", help="LABEL=PATH source roots (default: this interpreter's site-packages and stdlib)")
    a("--corpus-mb", type=int, default=T.corpus_mb)
    a("--tokenizer-sample-mb", type=int, default=T.tokenizer_sample_mb)
    a("--instruct-examples", type=int, default=T.instruct_examples)
    a("--write-function-weight", type=int, default=T.write_function_weight,
      help="code-writing requests per turn of the edit kinds (one of each)")
    a("--teacher-answers", default=None, metavar="ANSWERS.jsonl.gz",
      help="code-writing requests answered by a coder model (python -m alphallama.train.teach): they take "
           "the place of corpus answers, rendered with this model's template")
    a("--teacher-share", type=_share, default=None,
      help="share of the code-writing examples answered by the teacher (default: every answer the file has, "
           "the rest from the corpus)")
    a("--init-from", default=None, metavar="MODEL.gguf",
      help="continue training a model this trainer made (its MTP sidecar beside it): its weights, shape and "
           "tokenizer; the schedule starts afresh (give it a lower --lr)")
    a("--teacher-repeat", type=_positive, default=1,
      help="examples per teacher answer (a few thousand answers, e.g. written on a CPU, weigh more)")
    a("--vocab-size", type=int, default=T.vocab_size)
    a("--ctx", type=int, default=T.ctx_len)
    a("--d-model", type=int, default=T.d_model)
    a("--layers", type=int, default=T.n_layers)
    a("--heads", type=int, default=T.n_heads)
    a("--kv-heads", type=int, default=T.n_kv_heads)
    a("--head-dim", type=int, default=T.head_dim)
    a("--experts", type=int, default=T.n_experts)
    a("--experts-used", type=int, default=T.n_experts_used)
    a("--expert-ffn", type=int, default=T.d_ff_expert)
    a("--mtp-ffn", type=int, default=T.mtp_d_ff)
    a("--mtp-depths", type=int, default=T.mtp_depths)
    a("--mtp-weight", type=float, default=T.mtp_weight)
    a("--aux-weight", type=float, default=T.aux_weight)
    a("--ce-chunk", type=int, default=T.ce_chunk, help="rows a chunk of the cross-entropies (0: plain [B,T,V] logits)")
    a("--mtp-frac", type=float, default=T.mtp_frac, help="share of positions each MTP depth's loss scores a step")
    a("--unlikelihood", type=float, default=0.0, metavar="WEIGHT",
      help="add WEIGHT x the unlikelihood of the model's own loops (greedy rollouts' repeated n-grams; "
           "train/unlikely.py); 0: off")
    a("--unlikelihood-every", type=_positive, default=Unlikely.every, help="steps between unlikelihood terms")
    a("--unlikelihood-batch", type=_positive, default=Unlikely.batch, help="greedy rollouts a term")
    a("--unlikelihood-ngram", type=_positive, default=Unlikely.ngram,
      help="tokens of an n-gram whose repeat marks a loop")
    a("--anchor", type=float, default=0.0, metavar="WEIGHT",
      help="add WEIGHT x KL(start model || model) on the training windows: a run from --init-from "
           "changes what its other terms ask and keeps the rest of the start's distribution; 0: off")
    a("--batch-size", type=int, default=T.batch_size)
    a("--lr", type=float, default=T.lr)
    a("--warmup-steps", type=int, default=T.warmup_steps)
    a("--time-budget-s", type=float, default=T.time_budget_s, help="training seconds, summed over resumed calls")
    a("--deadline-s", type=float, default=None, help="wall seconds for this whole call: training stops in time to export")
    a("--continue-later", action="store_true",
      help="a later call with the same --work-dir resumes: the learning rate's schedule spans --time-budget-s, "
           "not this call's deadline (which only stops it)")
    a("--export-reserve-s", type=float, default=45.0)
    a("--checkpoint-every-s", type=float, default=T.checkpoint_every_s)
    a("--max-steps", type=int, default=None)
    a("--log-every", type=int, default=T.log_every)
    a("--quant", default="Q8_0", choices=["Q8_0", "Q5_1", "Q5_0", "F16", "F32"],
      help="the matrices' type in the exported GGUF (norms and router stay F32)")
    a("--split-mib", type=float, default=15.5,
      help="split each exported GGUF bigger than this into NAME.partNN of this size + NAME.sha256 (0: never)")
    a("--device", default="auto")
    a("--workers", type=int, default=16, help="processes making instruction examples")
    a("--seed", type=int, default=T.seed)
    a("--commit", default=None, help="the git commit to record (the device copy is no checkout)")
    a("--command", default=None, help="the command to record as provenance (default: this one)")
