"""Memory nodes (NUMA): on a host of several, the CPU expert workers and the host tier go on
the GPU's node, so the workers stream the host tier from local RAM and the GPU reads it
over PCIe without crossing the sockets' link. On a host of one node nothing here acts.

The topology is read from sysfs (no libnuma), under an injectable root (tests fake it):

    sys/devices/system/node/node<N>/cpulist     the node's cpus, "0-7,16-23"
    sys/bus/pci/devices/<bus id>/numa_node      a PCI device's node, -1: unknown

Pages go where they are first touched (Linux's default policy: the node of the cpu that
touches them), so the host tier is allocated, touched and pinned by a thread moved onto
the node's cpus for the while (`on_cpus`).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

NODES = "sys/devices/system/node"
PCI = "sys/bus/pci/devices"


def parse_cpulist(text: str) -> list[int]:
    """sysfs's cpu list ("0-7,16-23", "3", "" for a node without cpus) -> sorted cpu ids."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cpus)


def nodes(root: str | Path = "/") -> dict[int, list[int]]:
    """Node id -> its cpus; {} where sysfs has no node directory (not Linux, or no NUMA)."""
    base, out = Path(root) / NODES, {}
    for d in sorted(base.glob("node*")) if base.is_dir() else ():
        try:
            out[int(d.name[4:])] = parse_cpulist((d / "cpulist").read_text())
        except (OSError, ValueError):   # not a node<N> directory, or no cpulist
            continue
    return dict(sorted(out.items()))


def sysfs_bus_id(bus_id: str) -> str:
    """A PCI address as CUDA's runtime or nvidia-smi spell it ("00000000:1B:00.0", an 8-digit
    domain) -> sysfs's ("0000:1b:00.0")."""
    domain, _, rest = bus_id.strip().partition(":")
    return f"{int(domain, 16):04x}:{rest.lower()}"


def pci_node(bus_id: str, root: str | Path = "/") -> int | None:
    """The node of a PCI device (CUDA's bus id), None where unknown (-1, or no such file)."""
    try:
        node = int((Path(root) / PCI / sysfs_bus_id(bus_id) / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def props_bus_id(props) -> str | None:
    """A device's PCI address from torch's device properties: pci_domain_id, pci_bus_id and
    pci_device_id are ints there (as cudaDeviceProp's; a GPU is function 0), "0000:1b:00.0";
    a pci_bus_id that is already a string passes as it is. None where they are missing."""
    bus, domain, slot = (getattr(props, f"pci_{k}_id", None) for k in ("bus", "domain", "device"))
    if isinstance(bus, str) or None in (bus, domain, slot):
        return bus if isinstance(bus, str) else None
    return f"{domain:04x}:{bus:02x}:{slot:02x}.0"


def cuda_bus_id(device=None) -> str | None:
    """The PCI address of a CUDA device (None: the current one); None for a cpu device or
    where there is no CUDA."""
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return props_bus_id(torch.cuda.get_device_properties(dev.index if dev.index is not None
                                                         else torch.cuda.current_device()))


@dataclass(frozen=True)
class Placement:
    """Where a GPU's host-side work goes on a host of several nodes."""
    node: int                    # the GPU's node
    cpus: tuple[int, ...]        # this process's allowed cpus on that node, sorted
    n_nodes: int                 # nodes with cpus on the host

    def describe(self, workers: Iterable[int] = ()) -> str:
        """The plan's numa line; workers: the CPU workers' cpus (none: no workers)."""
        where = f"node {self.node} (the GPU's; {self.n_nodes} nodes)"
        if not (workers := set(workers)):
            return f"host tier pinned on {where}"
        if workers <= set(self.cpus):
            return f"CPU workers on {where}, {len(self.cpus)} cpus; host tier pinned there too"
        return (f"CPU workers on every node's cpus (too few allowed on the GPU's node {self.node}); "
                f"host tier pinned on {where}")


def placement(bus_id: str | None, allowed: Iterable[int], root: str | Path = "/") -> Placement | None:
    """The GPU's node and its allowed cpus, where placing pays: a host of more than one node
    with cpus, the GPU's node known and some of its cpus allowed; else None (place nothing)."""
    topo = {n: cpus for n, cpus in nodes(root).items() if cpus}
    node = pci_node(bus_id, root) if len(topo) > 1 and bus_id is not None else None
    if node not in topo:
        return None
    mine = tuple(sorted(set(topo[node]) & set(allowed)))
    return Placement(node, mine, len(topo)) if mine else None


def gpu_placement(device, allowed: Iterable[int] | None = None, root: str | Path = "/") -> Placement | None:
    """placement() for a torch device (None: the current CUDA device; a cpu device: None);
    allowed: None for this thread's affinity."""
    if allowed is None:
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return placement(cuda_bus_id(device), allowed, root)


@contextmanager
def on_cpus(cpus: Iterable[int] | None) -> Iterator[None]:
    """Run the block with this thread's affinity set to `cpus` (the kernel moves the thread
    there at once), and the previous affinity back afterwards, also on an exception. A
    no-op for None or no cpus, or where there is no sched_setaffinity."""
    cpus = set(cpus or ())
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)        # 0: the calling thread
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def touch_pages(t: torch.Tensor) -> torch.Tensor:
    """Write one byte of every page of a contiguous cpu tensor from the calling thread (torch's
    own fills may run on its pool's threads, wherever they sit): its pages are then mapped
    on this thread's node. The bytes are garbage either way: for tensors about to be filled."""
    if t.numel():
        page = os.sysconf("SC_PAGE_SIZE")
        b = t.view(-1).view(torch.uint8).numpy()   # [bytes]
        b[::page] = 0                               # numpy: a single-threaded strided write
        b[-1] = 0                                   # the last page, where t starts mid-page
    return t
