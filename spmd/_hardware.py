"""Device kinds for the cost model: compute rate, memory, and the links a ring collective runs over.

The figures are the vendors' published peaks (dense bf16 FLOP/s, HBM capacity, per-device interconnect
bandwidth in one direction), not measurements: the cost model ranks plans with them, it does not promise a time.
A mesh axis whose device groups stay within ``ici_devices`` consecutive devices (one GPU host's NVLink domain, a
TPU slice's ICI) uses the fast links; an axis that spans beyond them crosses the data-centre network.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One kind of device, as the cost model sees it.

    ``axis_bandwidth`` overrides the bandwidth (bytes/s per device) of named mesh axes, e.g. when two axes of a
    2-D tensor-parallel mesh sit on links of different speed.

    >>> h100 = HARDWARE["h100"]
    >>> h100.link(("tensor",), {"data": 2, "tensor": 8})  # inside one 8-GPU host: NVLink
    (450000000000.0, 5e-06)
    >>> h100.link(("data",), {"data": 2, "tensor": 8})  # across hosts: the network
    (50000000000.0, 2e-05)
    """

    name: str
    flops: float  # peak dense FLOP/s per device in the training dtype
    memory: int  # bytes of device memory
    ici_bandwidth: float  # bytes/s per device, one direction, over the fast links
    ici_latency: float  # seconds per collective over the fast links
    dcn_bandwidth: float  # bytes/s per device across hosts / slices
    dcn_latency: float
    ici_devices: int  # consecutive devices joined by the fast links
    utilisation: float = 0.5  # share of peak FLOP/s a well-tuned step reaches
    axis_bandwidth: tuple[tuple[str, float], ...] = ()
    # bytes/s per device between host and device memory, one direction: a PCIe 4.0 x16 link's effective rate
    # (offloaded state streams over it); PCIe 5.0 hosts reach about twice it: set it with dataclasses.replace.
    host_bandwidth: float = 25e9

    def with_axis_bandwidth(self, bandwidth: Mapping[str, float]) -> Hardware:
        """The same device with the bandwidth of some mesh axes set explicitly (bytes/s per device)."""
        for axis, value in bandwidth.items():
            if not value > 0:
                raise ValueError(f"Hardware: bandwidth of axis {axis!r} must be positive, got {value}")
        merged = dict(self.axis_bandwidth) | dict(bandwidth)
        return dataclasses.replace(self, axis_bandwidth=tuple(sorted(merged.items())))

    def link(self, axes: Sequence[str], mesh_shape: Mapping[str, int]) -> tuple[float, float]:
        """(bandwidth, latency) of a collective over ``axes``: the slowest link any of them crosses."""
        overrides = dict(self.axis_bandwidth)
        names = list(mesh_shape)
        bandwidth, latency = math.inf, 0.0
        for axis in axes:
            # Later mesh axes vary fastest over the device order, so an axis's groups span its size times theirs.
            span = math.prod(mesh_shape[a] for a in names[names.index(axis) :])
            on_ici = span <= self.ici_devices
            bw = overrides.get(axis, self.ici_bandwidth if on_ici else self.dcn_bandwidth)
            bandwidth = min(bandwidth, bw)
            latency = max(latency, self.ici_latency if on_ici else self.dcn_latency)
        return (bandwidth if axes else math.inf), latency


# Spec-sheet figures. GPUs: NVLink within an 8-GPU host (half the quoted bidirectional figure), one 400 Gb/s
# (H100/H200) or 200 Gb/s (A100) NIC per GPU across hosts. TPUs: ICI within a pod (a ring along one torus
# dimension uses two links), DCN across pods. "cpu": emulated devices sharing one host's memory bus.
HARDWARE: dict[str, Hardware] = {
    "tpu-v5e": Hardware("tpu-v5e", 197e12, 16 * GiB, 100e9, 3e-6, 12.5e9, 20e-6, 256),
    "tpu-v5p": Hardware("tpu-v5p", 459e12, 95 * GiB, 200e9, 3e-6, 25e9, 20e-6, 8960),
    "h100": Hardware("h100", 989e12, 80 * GiB, 450e9, 5e-6, 50e9, 20e-6, 8),
    "h200": Hardware("h200", 989e12, 141 * GiB, 450e9, 5e-6, 50e9, 20e-6, 8),
    "a100": Hardware("a100", 312e12, 80 * GiB, 300e9, 5e-6, 25e9, 20e-6, 8),
    "cpu": Hardware("cpu", 1e11, 16 * GiB, 10e9, 20e-6, 10e9, 20e-6, 1 << 20),
}


def hardware(kind: str) -> Hardware:
    """The :data:`HARDWARE` entry called ``kind`` (case-insensitive), with a clear error otherwise.

    >>> hardware("H100").memory // GiB
    80
    """
    key = kind.strip().lower()
    if key not in HARDWARE:
        raise ValueError(f"unknown device kind {kind!r}; choose from {', '.join(HARDWARE)}")
    return HARDWARE[key]


def detect(device_kind: str, platform: str) -> Hardware:
    """The entry matching a JAX device (``device.device_kind``, ``device.platform``); CPU when nothing matches.

    >>> detect("NVIDIA H100 80GB HBM3", "gpu").name, detect("TPU v5 lite", "tpu").name, detect("cpu", "cpu").name
    ('h100', 'tpu-v5e', 'cpu')
    """
    text = device_kind.lower()
    for needle, key in (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("v5 lite", "tpu-v5e")):
        if needle in text:
            return HARDWARE[key]
    if "v5e" in text:
        return HARDWARE["tpu-v5e"]
    if "v5" in text and platform == "tpu":
        return HARDWARE["tpu-v5p"]
    return HARDWARE["cpu"]
