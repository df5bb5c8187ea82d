"""NUMA placement (offload/numa.py): the topology read from fake sysfs trees, the CPU
workers' cpus on the GPU's node where the host has several (today's choice on one node),
the affinity held only for the block, and the host tier allocated under it."""
from __future__ import annotations

import dataclasses
import os
import types
from pathlib import Path

import pytest
import torch

from alphallama.gguf.reader import GGUFFile
from alphallama.offload import numa
from alphallama.offload.native import probe
from alphallama.offload.numa import Placement, nodes, on_cpus, parse_cpulist, pci_node, placement, sysfs_bus_id
from alphallama.offload.plan import make_plan
from alphallama.runtime.weights import BlockNames
from tests.offload.conftest import in_a_thread

GPU = "00000000:1B:00.0"          # CUDA's spelling; sysfs: 0000:1b:00.0
UNKNOWN = "00000000:3D:00.0"      # numa_node -1
ABSENT = "00000000:AF:00.0"       # no sysfs entry
NODE0 = list(range(0, 4)) + list(range(8, 12))
NODE1 = list(range(4, 8)) + list(range(12, 16))

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux thread affinity")


def fake_sysfs(root: Path, cpulists: dict[int, str], gpu_node: str = "1") -> Path:
    """A sysfs tree under root: node<N>/cpulist for each node, and the PCI devices' numa_node."""
    base = root / numa.NODES
    for n, text in cpulists.items():
        (base / f"node{n}").mkdir(parents=True)
        (base / f"node{n}" / "cpulist").write_text(text + "\n")
    (base / "possible").write_text("0-1\n")           # a file beside the node dirs, not a node
    (base / "power").mkdir()                           # a directory that is not a node either
    for bus, node in (("0000:1b:00.0", gpu_node), ("0000:3d:00.0", "-1")):
        (root / numa.PCI / bus).mkdir(parents=True)
        (root / numa.PCI / bus / "numa_node").write_text(node + "\n")
    return root


@pytest.fixture
def two_nodes(tmp_path) -> Path:
    return fake_sysfs(tmp_path / "two", {0: "0-3,8-11", 1: "4-7,12-15"})


@pytest.fixture
def one_node(tmp_path) -> Path:
    return fake_sysfs(tmp_path / "one", {0: "0-15"}, gpu_node="0")


# -- topology -----------------------------------------------------------------------
def test_parse_cpulist():
    assert parse_cpulist("0-7,16-23\n") == list(range(8)) + list(range(16, 24))
    assert parse_cpulist("3") == [3]
    assert parse_cpulist("0,2-3,2") == [0, 2, 3]
    assert parse_cpulist("\n") == []                  # a memory-only node


def test_nodes_and_pci_node(two_nodes, tmp_path_factory):
    assert nodes(two_nodes) == {0: NODE0, 1: NODE1}
    assert nodes(tmp_path_factory.mktemp("no-sysfs")) == {}
    assert sysfs_bus_id(GPU) == "0000:1b:00.0" and sysfs_bus_id("0000:1B:00.0") == "0000:1b:00.0"
    assert pci_node(GPU, two_nodes) == 1
    assert pci_node(UNKNOWN, two_nodes) is None       # -1: the firmware did not say
    assert pci_node(ABSENT, two_nodes) is None        # no such device


def test_bus_id_from_torchs_properties(two_nodes):
    """torch gives the address as ints (pci_domain_id, pci_bus_id, pci_device_id)."""
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0)
    assert numa.props_bus_id(props) == "0000:1b:00.0" and pci_node(numa.props_bus_id(props), two_nodes) == 1
    assert numa.props_bus_id(types.SimpleNamespace(pci_bus_id=GPU)) == GPU          # a string: as it is
    assert numa.props_bus_id(types.SimpleNamespace(pci_bus_id=0x1B)) is None        # no domain / slot
    assert numa.props_bus_id(types.SimpleNamespace()) is None


def test_placement(two_nodes, one_node, tmp_path):
    every = range(16)
    assert placement(GPU, every, two_nodes) == Placement(1, tuple(NODE1), 2)
    assert placement(GPU, [0, 1, 5, 13], two_nodes) == Placement(1, (5, 13), 2)   # the allowed ones only
    assert placement(GPU, NODE0, two_nodes) is None   # none of the GPU's node's cpus allowed
    for bus in (UNKNOWN, ABSENT, None):
        assert placement(bus, every, two_nodes) is None
    assert placement(GPU, every, one_node) is None    # one node: nothing to place
    cxl = fake_sysfs(tmp_path / "cxl", {0: "0-15", 1: ""}, gpu_node="0")   # a memory-only second node
    assert placement(GPU, every, cxl) is None


# -- the workers' cpus --------------------------------------------------------------
def today(allowed: list[int], here: int) -> list[int]:
    """usable_cpus before placement: the allowed cpus less the launch thread's."""
    return [c for c in allowed if c != here] or allowed[:1]


def test_workers_on_the_gpus_node(two_nodes):
    allowed = list(range(16))
    placed = placement(GPU, allowed, two_nodes)
    assert probe.choose_cpus(allowed, 0, placed) == NODE1               # launch thread elsewhere
    assert probe.choose_cpus(allowed, 5, placed) == [c for c in NODE1 if c != 5]
    few = placement(GPU, [0, 1, 2, 4, 5], two_nodes)                      # 2 of the node's cpus allowed
    assert probe.choose_cpus([0, 1, 2, 4, 5], 4, few) == [0, 1, 2, 5]   # 1 left there: today's choice
    assert probe.choose_cpus([0, 1, 2, 4, 5], 0, few) == [4, 5]
    unknown = placement(UNKNOWN, allowed, two_nodes)
    assert probe.choose_cpus(allowed, 3, unknown) == today(allowed, 3)


def test_one_node_hosts_choose_as_today(one_node):
    for allowed in ([0], [0, 1], list(range(16)), [2, 5, 9]):
        placed = placement(GPU, allowed, one_node)
        assert placed is None
        for here in (*allowed, 99):
            assert probe.choose_cpus(allowed, here, placed) == today(allowed, here)


def test_this_host_is_unchanged():
    """The machines here have one node (or no CUDA): no placement, the probe's key as before."""
    if len([n for n, cpus in nodes().items() if cpus]) > 1 and torch.cuda.is_available():
        pytest.skip("a host of several nodes with a GPU")
    assert probe.placement() is None
    assert numa.gpu_placement("cpu") is None and numa.cuda_bus_id("cpu") is None
    key = probe._host_key(1 << 20)
    assert key.endswith(f"|cpus={','.join(map(str, probe.allowed_cpus()))}|bytes={1 << 20}")


def test_probe_key_has_the_node(two_nodes):
    placed = placement(GPU, probe.allowed_cpus() + NODE1, two_nodes)
    key, plain = probe._host_key(1 << 20, placed), probe._host_key(1 << 20)
    assert f"|node=1:{','.join(map(str, placed.cpus))}|" in key and key != plain
    other = dataclasses.replace(placed, cpus=placed.cpus[:2])
    assert probe._host_key(1 << 20, other) != key     # a narrower node restriction: another entry


# -- affinity and first touch ---------------------------------------------------------
@needs_affinity
def test_on_cpus_sets_and_restores():
    def run():
        before = os.sched_getaffinity(0)
        one = {min(before)}
        with on_cpus(one):
            inside = os.sched_getaffinity(0)
        after = os.sched_getaffinity(0)
        with pytest.raises(KeyError):
            with on_cpus(one):
                raise KeyError("boom")
        after_error = os.sched_getaffinity(0)
        with on_cpus(None):
            untouched = os.sched_getaffinity(0)
        return before, one, inside, after, after_error, untouched

    before, one, inside, after, after_error, untouched = in_a_thread(run)
    assert inside == one and after == before and after_error == before and untouched == before


def test_touch_pages():
    t = torch.full((3 * 4096 + 5,), 0x0707, dtype=torch.int16)   # [n], int16: bytes 7, 7
    assert numa.touch_pages(t) is t
    b = t.view(torch.uint8)
    assert b[0] == 0 and b[-1] == 0 and b[4096] == 0 and int((b != 7).sum()) <= 2 * (len(b) // 4096 + 2)
    numa.touch_pages(torch.empty(0))


@needs_affinity
def test_host_tier_allocated_on_the_node(micro_moe, monkeypatch):
    """The store's host planes are allocated and first touched by a thread on the GPU's
    node's cpus (faked: the first allowed cpu), and the thread's affinity comes back."""
    from alphallama.offload import planes, store as store_mod
    seen: list[set[int]] = []
    real_touch = planes.touch_pages
    monkeypatch.setattr(planes, "touch_pages", lambda t: (seen.append(os.sched_getaffinity(0)), real_touch(t))[1])

    def build():
        before = os.sched_getaffinity(0)
        node = Placement(1, (min(before),), 2)
        monkeypatch.setattr(store_mod, "gpu_placement", lambda device: node)
        f = GGUFFile(micro_moe)
        layers = {i: tuple(f.tensors[x] for x in BlockNames(f"blk.{i}.").experts) for i in range(2)}
        messages: list[str] = []
        s = store_mod.ExpertStore(layers, 2, 6, 2, 2, "cpu", 4, progress=lambda m, n: messages.append(m))
        return before, node, s, messages, os.sched_getaffinity(0)

    before, node, s, messages, after = in_a_thread(build)
    assert seen and all(cpus == set(node.cpus) for cpus in seen) and after == before
    assert s.placement == node and any("host tier pinned on node 1" in m for m in messages)


def test_host_tier_not_touched_on_one_node(micro_moe, monkeypatch):
    from alphallama.offload import planes
    from alphallama.offload.store import ExpertStore
    monkeypatch.setattr(planes, "touch_pages", lambda t: pytest.fail("touched on a host of one node"))
    f = GGUFFile(micro_moe)
    layers = {i: tuple(f.tensors[x] for x in BlockNames(f"blk.{i}.").experts) for i in range(2)}
    assert ExpertStore(layers, 2, 6, 2, 2, "cpu", 4).placement is None


# -- what the plan says ----------------------------------------------------------------
def test_describe():
    p = Placement(1, tuple(NODE1), 2)
    assert p.describe(NODE1[:4]) == "CPU workers on node 1 (the GPU's; 2 nodes), 8 cpus; host tier pinned there too"
    assert p.describe() == "host tier pinned on node 1 (the GPU's; 2 nodes)"
    assert "every node's cpus" in p.describe([0, 1])


def test_plan_says_the_node_only_where_it_matters(micro_moe, monkeypatch):
    from alphallama.offload import plan as plan_mod
    s = make_plan(micro_moe, ctx=128, gpu_mem=1 << 40).sizes
    budget = s.dense + s.kv + s.workspace + s.experts // 2
    plain = make_plan(micro_moe, ctx=128, gpu_mem=budget)
    assert plain.layout == "offload"
    if probe.placement() is None:                       # one node here: nothing new
        assert plain.numa == "" and "numa" not in plain.describe()
    node = Placement(1, tuple(range(64)), 2)             # every cpu here is "on the GPU's node"
    monkeypatch.setattr(plan_mod, "gpu_placement", lambda device: node)
    placed = make_plan(micro_moe, ctx=128, gpu_mem=budget)
    assert placed.numa == (node.describe(range(placed.cpu_threads)) if placed.cpu_threads else node.describe())
    assert f"numa       {placed.numa}" in placed.describe()
