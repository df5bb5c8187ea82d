"""The plan for real hosts: the host tier's RAM budget and the layers it maps (the store
decides the same), the cost model at given bandwidths, and what `alphallama plan` prints."""
from __future__ import annotations

import argparse
import json

import pytest

from alphallama.cli import main
from alphallama.config import DEFAULTS
from alphallama.gguf.reader import GGUFFile
from alphallama.gguf.writer import PRESETS, write_synthetic
from alphallama.offload.apply import engine_kwargs
from alphallama.offload.estimate import host_budget
from alphallama.offload.host_probe import Bandwidths
from alphallama.offload.plan import make_plan, priced
from alphallama.offload.store import ExpertStore
from alphallama.runtime.weights import BlockNames

CTX = 256
BW = Bandwidths(ram=50e9, disk=2e9, page_cache=20e9, pcie=25e9, gpu=3e12, source="test")


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("plan_host") / "moe.gguf"
    write_synthetic(PRESETS["tiny-qwen3moe"](n_layers=4, quant="Q4_K_M"), path)   # Q6_K / Q4_K down: 2 classes
    return str(path)


def _offload(path: str, frac: float, host_mem: int | None, bw: Bandwidths | None = BW):
    s = make_plan(path, ctx=CTX, gpu_mem=1 << 40).sizes
    return make_plan(path, ctx=CTX, gpu_mem=s.dense + s.kv + s.workspace + int(frac * s.experts),
                     host_mem=host_mem, bandwidths=bw)


def test_host_budget_rule():
    keep = 1 - DEFAULTS.offload.host_headroom
    assert host_budget(None, 1000) == (int(1000 * keep), "available RAM less 20%")
    assert host_budget(500, 1000) == (500, "--host-mem")
    assert host_budget(5000, 1000)[0] == int(1000 * keep) and "below --host-mem" in host_budget(5000, 1000)[1]
    assert host_budget(None, None)[0] is None


def test_mapped_layers_at_host_budgets_match_the_store(moe):
    f = GGUFFile(moe)
    layers = {i: tuple(f.tensors[x] for x in BlockNames(f"blk.{i}.").experts) for i in range(4)}
    store = ExpertStore(layers, 4, 8, 2, 2, "cpu", 4)
    per = {i: store.layer_bytes(i) for i in range(4)}
    assert dict(make_plan(moe, ctx=CTX, gpu_mem=1 << 40).sizes.layer_experts) == per   # plan sizes == runtime's
    for cap, want in ((sum(per.values()), ()), (per[0] + per[1], (2, 3)), (per[0], (1, 2, 3)), (0, (0, 1, 2, 3))):
        p = _offload(moe, 0.5, cap)
        assert p.layout == "offload" and p.host.mapped_layers == want, cap
        assert p.host.mapped_experts == 8 * len(want) and p.host.ram_experts == 8 * (4 - len(want))
        assert p.host_bytes == (cap if want else None)
        assert engine_kwargs(argparse.Namespace(ctx_size=None, device="auto"), p)["host_bytes"] == p.host_bytes
        s = ExpertStore(layers, 4, 8, 2, 2, "cpu", 4, host_bytes=cap)
        assert tuple(sorted(s.mapped)) == want and s.host_bytes == p.host.ram_bytes


def test_cost_model(moe):
    resident = make_plan(moe, ctx=CTX, gpu_mem=1 << 40, bandwidths=BW)
    assert resident.layout == "resident" and resident.estimate.hit_rate == 1.0
    s, e = resident.sizes, resident.estimate
    o = DEFAULTS.offload
    want_ms = 1e3 * (s.dense / BW.gpu + 4 * o.layer_fixed_s + 4 * 2 * s.experts / s.n_experts / BW.gpu)
    assert e.ms_round == pytest.approx(want_ms, rel=1e-3) and e.tok_s == pytest.approx(1e3 / e.ms_round)
    half, quarter = _offload(moe, 0.5, None), _offload(moe, 0.25, None)
    assert resident.estimate.tok_s > half.estimate.tok_s > quarter.estimate.tok_s
    assert half.estimate.hit_rate == pytest.approx(half.slots / s.n_experts)
    # the miss rates (what the speculation gate prices a column's misses with, offload_costs.py) go to the engine
    cpu = BW.ram * o.worker_efficiency
    share = cpu / (cpu + BW.pcie)                                    # where both pipes finish together
    assert half.estimate.miss.share == pytest.approx(share if half.cpu_threads else 0.0)
    assert half.estimate.miss.host == pytest.approx(1 / (cpu + BW.pcie) if half.cpu_threads else 1 / BW.pcie)
    assert engine_kwargs(argparse.Namespace(ctx_size=None, device="auto"), half)["miss_rates"] == half.estimate.miss
    mapped = _offload(moe, 0.25, 0)                                  # every MoE layer mapped
    assert mapped.estimate.parts_ms["mapped"] > 0 and mapped.estimate.parts_ms["ram"] == 0
    cold = _offload(moe, 0.25, 0, Bandwidths(ram=50e9, disk=1e8, page_cache=None, pcie=25e9, gpu=3e12))
    assert cold.estimate.tok_s < mapped.estimate.tok_s           # no page cache measured: the disk prices it
    assert _offload(moe, 0.5, None, Bandwidths(ram=50e9)).estimate.assumed   # no GPU measured: said so
    # the disk not measurable (the probe could not drop its pages): the assumed disk prices it, and is named
    blind = _offload(moe, 0.25, 0, Bandwidths(ram=50e9, disk=None, page_cache=None, pcie=25e9, gpu=3e12))
    o_disk = DEFAULTS.offload.assumed_disk_bw
    assert blind.estimate.miss.mapped == pytest.approx(1 / min(50e9 * o.worker_efficiency, o_disk))
    assert any(a.startswith("disk ") for a in blind.estimate.assumed) and not mapped.estimate.assumed
    assert json.loads(json.dumps(mapped.to_dict()))["host"]["mapped_experts"] == 32
    assert priced(make_plan(moe, ctx=CTX, device="cpu"), BW).estimate is None   # the cpu layout: no estimate


def test_plan_command_prints_the_host_layout(moe, capsys):
    s = make_plan(moe, ctx=CTX, gpu_mem=1 << 40).sizes
    budget = s.dense + s.kv + s.workspace + s.experts // 2
    assert main(["plan", "-m", moe, "-c", str(CTX), "--gpu-mem", str(budget), "--host-mem", "1K"]) == 0
    out = capsys.readouterr().out
    assert "0 experts in pinned RAM" in out and "32 mapped from the file" in out
    assert "mapped     4 of 4 MoE layers' experts" in out and "host RAM   1.00 KiB for the host tier (--host-mem)" in out
    assert "bandwidth  RAM" in out and "expected   " in out and "tok/s" in out
    assert main(["plan", "-m", moe, "-c", str(CTX), "--gpu-mem", str(budget), "--no-probe", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["estimate"] is None and d["host"]["mapped_layers"] == [] and d["host"]["ram_experts"] == 32
    with pytest.raises(SystemExit):                                  # argparse's own error for a bad size
        main(["plan", "-m", moe, "--host-mem", "lots"])


def test_disk_probe_reads_from_the_disk_or_says_it_cannot(tmp_path):
    """A file just written has dirty pages, which posix_fadvise never drops: the probe syncs
    first, so its cold read starts with the range out of the page cache; where the pages stay
    (tmpfs, or a process mapping them) it reports no disk rate rather than the cache's."""
    import numpy as np
    from alphallama.offload import host_probe
    path = tmp_path / "blob.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes())
    assert host_probe.cached_share(str(path), 0, 8 << 20) > 0.9        # written: in the page cache
    held = np.memmap(path, dtype=np.uint8, mode="r")
    int(held[::4096].sum())                                             # mapped and touched by this process
    cold, cached = host_probe.file_rates(str(path), 8 << 20)
    assert cold is None and cached > 0                                  # could not be dropped: no disk figure
    del held
    cold, cached = host_probe.file_rates(str(path), 8 << 20)
    if host_probe.cached_share(str(path), 0, 4096) == 1.0 and cold is None:
        pytest.skip(f"{tmp_path}'s file system keeps its pages in memory (tmpfs): no disk to measure")
    assert cold is not None and cold > 0 and cached > 0
