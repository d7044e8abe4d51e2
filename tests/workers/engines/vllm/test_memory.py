"""The vllm engine's memory sizing without vLLM: each of several engines on one host takes its share, the user's
own setting wins, and a start-up that vLLM could not fit says which setting fixes it, with a value."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from workers.engines.vllm.memory import (
    GiB,
    HostMemory,
    MemoryShareError,
    MiB,
    host_memory,
    memory_engine_args,
    parse_size,
    startup_failure_hint,
)

# A machine where vLLM refused to start, saying "Available memory on node 0 (13.3/16.34 GiB)".
REFUSED_HOST = HostMemory(node=0, total=int(16.34 * GiB), available=int(13.3 * GiB))
WEIGHTS = 517 * MiB  # the converted SmolLM2 checkpoint


def unreadable() -> HostMemory:
    raise AssertionError("memory must not be read here")


def args(*, kv: int | None = None, utilization: float | None = None, engines: int = 2, on_cpu: bool = True,
         environ: dict[str, str] | None = None) -> dict[str, object]:
    return memory_engine_args(kv_cache_memory_bytes=kv, gpu_memory_utilization=utilization, engines_on_host=engines,
                              on_cpu=on_cpu, environ=environ or {}, memory=lambda: REFUSED_HOST,
                              weights=lambda: WEIGHTS)


def test_two_cpu_engines_each_get_an_explicit_kv_cache_and_together_fit() -> None:
    shared = args(engines=2)
    assert list(shared) == ["kv_cache_memory_bytes"]  # explicit: vLLM then skips its 0.92-of-the-node check
    kv = shared["kv_cache_memory_bytes"]
    assert isinstance(kv, int) and kv % MiB == 0
    # Both engines' KV, weights and runtime fit in what was available, with room to spare.
    assert 2 * (kv + WEIGHTS + 2 * GiB) <= 0.9 * REFUSED_HOST.available
    assert kv > 2 * GiB  # and each still has a useful cache (more than the 2 GiB the docs used to set by hand)


def test_three_engines_get_smaller_shares_than_two() -> None:
    two, three = args(engines=2)["kv_cache_memory_bytes"], args(engines=3)["kv_cache_memory_bytes"]
    assert isinstance(two, int) and isinstance(three, int) and three < two


def test_gpu_engines_split_vllms_utilization() -> None:
    assert args(engines=2, on_cpu=False) == {"gpu_memory_utilization": 0.46}
    assert args(engines=3, on_cpu=False) == {"gpu_memory_utilization": 0.3}


def test_an_engine_alone_keeps_vllms_defaults() -> None:
    assert memory_engine_args(kv_cache_memory_bytes=None, gpu_memory_utilization=None, engines_on_host=1,
                              on_cpu=True, environ={}, memory=unreadable, weights=lambda: WEIGHTS) == {}


@pytest.mark.parametrize(("kv", "utilization", "environ", "expected"), [
    (3 * GiB, None, {}, {"kv_cache_memory_bytes": 3 * GiB}),
    (None, 0.3, {}, {"gpu_memory_utilization": 0.3}),
    (None, None, {"VLLM_CPU_KVCACHE_SPACE": "2"}, {}),  # vLLM reads it itself, over any engine argument
])
def test_the_users_own_setting_wins(kv: int | None, utilization: float | None, environ: dict[str, str],
                                    expected: dict[str, object]) -> None:
    got = memory_engine_args(kv_cache_memory_bytes=kv, gpu_memory_utilization=utilization, engines_on_host=2,
                             on_cpu=True, environ=environ, memory=unreadable, weights=lambda: WEIGHTS)
    assert got == expected


def test_a_host_too_small_for_its_engines_refuses_naming_the_settings() -> None:
    small = HostMemory(0, 8 * GiB, 5 * GiB)
    with pytest.raises(MemoryShareError, match="--kv-cache-memory-bytes") as caught:
        memory_engine_args(kv_cache_memory_bytes=None, gpu_memory_utilization=None, engines_on_host=2, on_cpu=True,
                           environ={}, memory=lambda: small, weights=lambda: WEIGHTS)
    assert "VLLM_CPU_KVCACHE_SPACE" in str(caught.value)


def test_vllms_memory_refusal_on_the_cpu_says_what_to_set_with_values_that_fit() -> None:
    hint = startup_failure_hint(True, REFUSED_HOST, WEIGHTS, None, None, {})
    assert hint is not None
    assert "0.92" in hint and "15.03 GiB" in hint and "13.30 of 16.34 GiB" in hint
    # A KV cache that fits what is available (13.3 * 0.9 - weights - runtime = 9.5 GiB), in both spellings.
    assert "--kv-cache-memory-bytes 9G" in hint and "VLLM_CPU_KVCACHE_SPACE=9" in hint
    assert "--gpu-memory-utilization 0.73" in hint  # 13.3 * 0.9 / 16.34
    assert "--engines-on-host" in hint


def test_a_kv_cache_asked_for_beyond_the_available_memory_is_named() -> None:
    hint = startup_failure_hint(True, REFUSED_HOST, WEIGHTS, None, None, {"VLLM_CPU_KVCACHE_SPACE": "14"})
    assert hint is not None and "(14.00 GiB)" in hint and "--kv-cache-memory-bytes 9G" in hint
    hint = startup_failure_hint(True, REFUSED_HOST, WEIGHTS, 20 * GiB, None, {})
    assert hint is not None and "(20.00 GiB)" in hint


def test_no_hint_where_memory_was_not_the_cause() -> None:
    roomy = HostMemory(0, 64 * GiB, 60 * GiB)
    assert startup_failure_hint(True, roomy, WEIGHTS, None, None, {}) is None
    assert startup_failure_hint(True, REFUSED_HOST, WEIGHTS, 4 * GiB, None, {}) is None
    assert startup_failure_hint(True, REFUSED_HOST, WEIGHTS, None, 0.5, {}) is None
    assert startup_failure_hint(False, None, WEIGHTS, None, None, {}) is None


def test_host_memory_reads_the_numa_node_as_vllm_counts_it_clamped_to_the_cgroup(tmp_path: Path) -> None:
    cpu = sorted(os.sched_getaffinity(0))[0]
    (tmp_path / f"sys/devices/system/cpu/cpu{cpu}/node1").mkdir(parents=True)
    node = tmp_path / "sys/devices/system/node/node1"
    node.mkdir(parents=True)
    node.joinpath("meminfo").write_text(
        "Node 1 MemTotal:       16000000 kB\nNode 1 MemFree:         8000000 kB\n"
        "Node 1 Active(file):    1000000 kB\nNode 1 Inactive(file):  2000000 kB\nNode 1 SReclaimable:     500000 kB\n")
    assert host_memory(tmp_path) == HostMemory(1, 16000000 * 1024, 11500000 * 1024)
    cgroup = tmp_path / "sys/fs/cgroup"
    cgroup.mkdir(parents=True)
    cgroup.joinpath("memory.max").write_text(f"{8 * GiB}\n")
    cgroup.joinpath("memory.current").write_text(f"{3 * GiB}\n")
    assert host_memory(tmp_path) == HostMemory(1, 8 * GiB, 5 * GiB)
    cgroup.joinpath("memory.max").write_text("max\n")
    assert host_memory(tmp_path).total == 16000000 * 1024


def test_host_memory_without_numa_nodes_reads_proc_meminfo(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 4000 kB\nMemFree: 1000 kB\nMemAvailable: 3000 kB\n")
    assert host_memory(tmp_path) == HostMemory(0, 4000 * 1024, 3000 * 1024)


@pytest.mark.parametrize(("text", "size"), [("4G", 4 * GiB), ("4g", 4 * 10**9), ("512M", 512 * MiB),
                                            ("1.5G", int(1.5 * GiB)), ("123456", 123456)])
def test_sizes_read_as_vllm_reads_them(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "4X", "-1", "0"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)
