"""bench/gpu_offload_llamacpp.py on the CPU: llama.cpp's --n-cpu-moe placement per fraction on a
tiny synthetic MoE file against hand-computed values, the -ot regex against llama.cpp's own
per-layer patterns, and the whole run against a stand-in llama-bench (no llama.cpp here)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from gpu_offload_llamacpp import (EXPS_REGEX, bench_cmd, choose_n, gpu_expert_bytes, layer_expert_bytes,  # noqa: E402
                                  ot_regex, parse_buffers, placement, ratios, summarize)

# tiny-qwen3moe, 8 layers, Q4_K_M: 8 experts of 256 x 256 per tensor; gate and up Q4_K
# (8 x 256 rows x 144 B = 294912 B each), down Q6_K (210 B a block: 430080 B) in layers
# 0, 3, 6, 7 (the mix's more-bits layers) and Q4_K elsewhere.
A = 2 * 294912 + 430080     # 1019904
B = 3 * 294912              # 884736
LAYERS = [A, B, B, A, B, B, A, A]
TOTAL = sum(LAYERS)         # 7618560


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from alphallama.gguf.writer import PRESETS, write_synthetic
    path = tmp_path_factory.mktemp("ncmoe") / "tiny-moe.gguf"
    write_synthetic(PRESETS["tiny-qwen3moe"](n_layers=8, quant="Q4_K_M"), path)
    return path


def test_layer_bytes_from_the_file(tiny):
    from alphallama.gguf.reader import GGUFFile
    assert layer_expert_bytes(GGUFFile(tiny)) == dict(enumerate(LAYERS))


def test_choose_n_hand_computed():
    lb = dict(enumerate(LAYERS))
    # GPU bytes for N = 0..8: the suffix sums
    assert [gpu_expert_bytes(lb, n) for n in range(9)] == [7618560, 6598656, 5713920, 4829184, 3809280,
                                                           2924544, 2039808, 1019904, 0]
    assert choose_n(lb, 8, TOTAL) == 0
    assert choose_n(lb, 8, TOTAL // 2) == 4            # 3809280: equal to the target is kept
    assert choose_n(lb, 8, TOTAL // 2 - 1) == 5
    assert choose_n(lb, 8, TOTAL // 4) == 7            # 1904640: N = 6 leaves 2039808, above
    assert choose_n(lb, 8, TOTAL // 10) == 8           # 761856: below one layer, all to the CPU
    # a leading dense layer (no experts): N counts it, the smallest N wins the tie
    assert choose_n({1: 10, 2: 10}, 3, 10) == 2
    assert choose_n({1: 10, 2: 10}, 3, 20) == 0


def test_placement_both_bases():
    lb = dict(enumerate(LAYERS))
    ours = 7782400                                     # our device bytes of these experts (planes)
    rows = placement(lb, 8, [1.0, 0.5, 0.25, 0.1], ours, "both")
    got = {(r["fraction"], r["basis"]): (r["target_bytes"], r["n_cpu_moe"]) for r in rows}
    assert got == {(1.0, "bytes"): (7782400, 0), (1.0, "fraction"): (7618560, 0),
                   (0.5, "bytes"): (3891200, 4), (0.5, "fraction"): (3809280, 4),
                   (0.25, "bytes"): (1945600, 7), (0.25, "fraction"): (1904640, 7),
                   (0.1, "bytes"): (778240, 8), (0.1, "fraction"): (761856, 8)}
    assert all(r["gpu_expert_bytes"] <= r["target_bytes"] for r in rows)
    # N = 3 leaves 4829184 B: 0.62 x ours (4825088) is just below it, 0.63 (4902912) above
    assert placement(lb, 8, [0.62], ours, "bytes")[0]["n_cpu_moe"] == 4
    assert placement(lb, 8, [0.63], ours, "bytes")[0]["n_cpu_moe"] == 3


def test_ot_regex_equals_n_cpu_moe():
    assert ot_regex(0) is None
    assert ot_regex(3) == r"blk\.(0|1|2)\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU"
    names = [f"blk.{i}.ffn_{k}_{e}.weight" for i in range(12) for k in ("gate", "up", "down", "gate_up")
             for e in ("exps", "chexps", "shexp")] + [f"blk.{i}.ffn_gate_inp.weight" for i in range(12)]
    for n in (1, 2, 3, 10, 11, 12):
        mine = re.compile(ot_regex(n).removesuffix("=CPU"))
        theirs = [re.compile(rf"blk\.{i}{EXPS_REGEX}") for i in range(n)]   # common.h llm_ffn_block_regex
        for name in names:
            assert bool(mine.search(name)) == any(p.search(name) for p in theirs), (n, name)
    assert not re.search(ot_regex(2).removesuffix("=CPU"), "blk.10.ffn_up_exps.weight")
    assert re.search(ot_regex(2).removesuffix("=CPU"), "blk.1.ffn_up_exps.weight")
    assert not re.search(ot_regex(12).removesuffix("=CPU"), "blk.3.ffn_up_shexp.weight")


def test_bench_cmd():
    assert bench_cmd("lb", "F", 0, [8], ["auto"], 3, False) == \
        ["lb", "-m", "F", "-ngl", "99", "-fa", "1", "-t", "8", "-p", "512", "-n", "128", "-r", "3", "-o", "json"]
    c = bench_cmd("lb", "F", 5, [8, 16], ["auto", "none"], 3, False)
    assert c[7:13] == ["--n-cpu-moe", "5", "-t", "8,16", "-lm", "auto,none"]
    c = bench_cmd("lb", "F", 2, [8], ["auto"], 1, True, check=True)
    assert c[7:] == ["-ot", r"blk\.(0|1)\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU", "-t", "8",
                     "-p", "0", "-n", "1", "-r", "1", "-v", "-o", "json"]


def test_parse_buffers_and_summarize():
    log = ("load_tensors: offloaded 13/13 layers to GPU\n"
           "load_tensors:        CUDA0 model buffer size =  1234.50 MiB\n"
           "load_tensors:   CPU_Mapped model buffer size =   100.25 MiB\n"
           "load_tensors:   CPU_Mapped model buffer size =    10.00 MiB\n")
    assert parse_buffers(log) == {"CUDA0": 1234.5, "CPU_Mapped": 110.25}
    rows = [{"n_threads": 8, "load_mode": "auto", "n_prompt": 512, "n_gen": 0, "avg_ts": 900.0, "stddev_ts": 1.0},
            {"n_threads": 8, "load_mode": "auto", "n_prompt": 0, "n_gen": 128, "avg_ts": 90.0, "stddev_ts": 0.5}]
    assert summarize(rows) == [{"n_threads": 8, "load_mode": "auto", "pp512": 900.0, "pp512_std": 1.0,
                                "tg128": 90.0, "tg128_std": 0.5}]


def test_ratios():
    place = [{"fraction": 1.0, "basis": "bytes", "n_cpu_moe": 0}, {"fraction": 0.25, "basis": "bytes", "n_cpu_moe": 9}]
    runs = {0: {"arms": [{"n_threads": 8, "load_mode": "auto", "tg128": 200.0, "pp512": 5000.0}]},
            9: {"arms": [{"n_threads": 8, "load_mode": "auto", "tg128": 50.0},
                         {"n_threads": 16, "load_mode": "none", "tg128": 80.0}]}}
    ours = {"rows": [{"config": "resident (no store)", "tok_s": 600.0, "ms_per_round": 1.6},
                     {"config": "store, --gpu-mem for 100% of experts", "tok_s": 230.0, "hit_rate": 1.0},
                     {"config": "store, --gpu-mem for 25% of experts", "tok_s": 40.0, "ms_per_round": 25.0,
                      "hit_rate": 0.4}]}
    r = {x["fraction"]: x for x in ratios(place, runs, ours)}
    assert r[1.0]["ours_over_llama_tok_s"] == pytest.approx(230 / 200)
    assert r[0.25]["llama_tg128"] == 80.0 and r[0.25]["llama_best_arm"] == {"n_threads": 16, "load_mode": "none"}
    assert r[0.25]["ours_over_llama_tok_s"] == pytest.approx(0.5) and r[0.25]["ours_hit_rate"] == 0.4
    assert r["resident"]["ours_over_llama_tok_s"] == pytest.approx(3.0)


FAKE = r'''
import json, sys
a = sys.argv[1:]
def val(flag, d):
    return a[a.index(flag) + 1] if flag in a else d
n = int(val("--n-cpu-moe", "0"))
if "-v" in a:
    print(f"load_tensors:        CUDA0 model buffer size = {100.0 - 10 * n:8.2f} MiB", file=sys.stderr)
rows = []
for t in val("-t", "4").split(","):
    for lm in val("-lm", "auto").split(","):
        for p, g in ((int(val("-p", "512")), 0), (0, int(val("-n", "128")))):
            if p or g:
                rows.append({"n_threads": int(t), "load_mode": lm, "n_cpu_moe": n, "n_prompt": p, "n_gen": g,
                             "avg_ts": 1000.0 / (1 + n) + int(t) + (lm == "none"), "stddev_ts": 0.1})
print(json.dumps(rows))
'''


def test_run_against_a_stand_in_llama_bench(tiny, tmp_path):
    fake = tmp_path / "bin" / "llama-bench"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\n" + FAKE)
    fake.chmod(0o755)
    ours = tmp_path / "ours.json"
    ours.write_text(json.dumps({"rows": [{"config": "store, --gpu-mem for 50% of experts", "tok_s": 100.0}]}))
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(ROOT / "src"), "GIT_COMMIT": "abc"}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_offload_llamacpp.py"), "--gguf", str(tiny),
                        "--bin", str(fake.parent), "--threads", "2", "3", "--ours", str(ours)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    (res_path,) = out.glob("gpu_offload_llamacpp-tiny-moe-*.json")
    res = json.loads(res_path.read_text())
    assert res["commit"] == "abc" and res["n_layers"] == 8 and res["file_expert_bytes"] == TOTAL
    assert sorted(map(int, res["runs"])) == [0, 4, 7, 8]
    assert len(res["runs"]["0"]["arms"]) == 1 and len(res["runs"]["4"]["arms"]) == 4   # 2 threads x 2 modes
    assert res["runs"]["7"]["cuda0_moved_mib"] == pytest.approx(70.0)
    r50 = next(r for r in res["ratios"] if r["fraction"] == 0.5)
    assert r50["n_cpu_moe"] == 4 and r50["llama_tg128"] == pytest.approx(200 + 3 + 1)
    assert r50["ours_over_llama_tok_s"] == pytest.approx(100 / 204)
    again = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_offload_llamacpp.py"), "--from-json",
                            str(res_path), "--ours", str(ours)], env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "ours/llama" in again.stdout
