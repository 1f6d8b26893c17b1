"""vramkit.devices.host: host memory from fake /proc and cgroup trees (v2, v1, WSL, missing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramkit.devices import host as host_module
from vramkit.devices.host import (
    HostMemory,
    HostMemoryChoice,
    choose_host_memory,
    read_host_memory,
)

GiB = 1 << 30
MiB = 1 << 20
V1_UNLIMITED = 9223372036854771712


def _write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _proc(root: Path, *, total_kib: int = 16 * MiB, available_kib: int = 12 * MiB,
          rss_kib: int = 512 * 1024, release: str = "6.8.0-45-generic",
          cgroup: str = "0::/user.slice/session-1.scope\n") -> None:
    _write(root, "proc/meminfo", f"MemTotal:       {total_kib} kB\nMemFree:         1000 kB\n"
                                 f"MemAvailable:   {available_kib} kB\nBuffers:  10 kB\n")
    _write(root, "proc/self/status", f"Name:\tpython3\nVmPeak:\t  999999 kB\n"
                                     f"VmRSS:\t  {rss_kib} kB\nThreads:\t4\n")
    _write(root, "proc/sys/kernel/osrelease", release + "\n")
    _write(root, "proc/self/cgroup", cgroup)


def _cgroup_v2(root: Path, path: str, files: dict[str, str]) -> None:
    _write(root, "sys/fs/cgroup/cgroup.controllers", "cpu io memory pids\n")
    for name, text in files.items():
        _write(root, f"sys/fs/cgroup/{path}/{name}".replace("//", "/"), text)


@pytest.fixture(autouse=True)
def _memlock(monkeypatch: pytest.MonkeyPatch) -> None:
    # RLIMIT_MEMLOCK is the process's own; pin it so results do not depend on the machine.
    monkeypatch.setattr(host_module, "_memlock_limit", lambda: 8 * MiB)


def test_proc_figures_are_read_in_bytes(tmp_path: Path) -> None:
    _proc(tmp_path)
    memory = read_host_memory(root=str(tmp_path))
    assert memory.total == 16 * GiB
    assert memory.available == 12 * GiB
    assert memory.process_rss == 512 * MiB
    assert memory.wsl is False
    assert memory.memlock_limit == 8 * MiB
    assert memory.cgroup_limit is None and memory.cgroup_usage is None
    # RLIMIT_MEMLOCK does not cap CUDA pinning: with no cgroup limit and no WSL there is none.
    assert memory.pin_limit is None and memory.pin_limit_source == "none"
    assert memory.headroom == 12 * GiB


def test_cgroup_v2_limit_caps_pinning_and_headroom(tmp_path: Path) -> None:
    _proc(tmp_path, cgroup="0::/docker/abc\n")
    _cgroup_v2(tmp_path, "docker/abc", {"memory.max": f"{8 * GiB}\n",
                                        "memory.current": f"{6 * GiB}\n"})
    memory = read_host_memory(root=str(tmp_path))
    assert memory.cgroup_limit == 8 * GiB
    assert memory.cgroup_usage == 6 * GiB
    assert memory.pin_limit == 8 * GiB
    assert memory.pin_limit_source == "cgroup memory.max"
    assert memory.headroom == 2 * GiB  # the cgroup's room, tighter than MemAvailable's 12 GiB


def test_cgroup_v2_max_means_no_limit(tmp_path: Path) -> None:
    _proc(tmp_path)
    _cgroup_v2(tmp_path, "user.slice/session-1.scope",
               {"memory.max": "max\n", "memory.current": f"{300 * MiB}\n"})
    memory = read_host_memory(root=str(tmp_path))
    assert memory.cgroup_limit is None
    assert memory.cgroup_usage == 300 * MiB
    assert memory.pin_limit is None
    assert memory.headroom == 12 * GiB


def test_cgroup_v2_the_smallest_ancestor_limit_is_in_effect(tmp_path: Path) -> None:
    _proc(tmp_path, cgroup="0::/outer/inner\n")
    _cgroup_v2(tmp_path, "outer", {"memory.max": f"{4 * GiB}\n",
                                   "memory.current": f"{3 * GiB}\n"})
    _cgroup_v2(tmp_path, "outer/inner", {"memory.max": "max\n",
                                         "memory.current": f"{1 * GiB}\n"})
    memory = read_host_memory(root=str(tmp_path))
    assert (memory.cgroup_limit, memory.cgroup_usage) == (4 * GiB, 3 * GiB)
    assert memory.headroom == 1 * GiB


def test_cgroup_v2_in_a_container_without_cgroup_namespace(tmp_path: Path) -> None:
    # /proc/self/cgroup names the host's path; the mount's root is the container's cgroup.
    _proc(tmp_path, cgroup="0::/system.slice/docker-0123.scope\n")
    _cgroup_v2(tmp_path, "", {"memory.max": f"{2 * GiB}\n", "memory.current": f"{1 * GiB}\n"})
    memory = read_host_memory(root=str(tmp_path))
    assert memory.cgroup_limit == 2 * GiB
    assert memory.pin_limit == 2 * GiB


def test_cgroup_limit_above_ram_does_not_cap_pinning(tmp_path: Path) -> None:
    _proc(tmp_path, cgroup="0::/big\n")
    _cgroup_v2(tmp_path, "big", {"memory.max": f"{64 * GiB}\n",
                                 "memory.current": f"{1 * GiB}\n"})
    memory = read_host_memory(root=str(tmp_path))
    assert memory.cgroup_limit == 64 * GiB
    assert memory.pin_limit is None and memory.pin_limit_source == "none"


def test_cgroup_v1(tmp_path: Path) -> None:
    _proc(tmp_path, cgroup="5:cpu,cpuacct:/\n4:memory:/kubepods/pod1\n0::/\n")
    # A hybrid system: the v2 tree in unified/ (no cgroup.controllers at the root).
    _write(tmp_path, "sys/fs/cgroup/unified/cgroup.procs", "")
    _write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", f"{V1_UNLIMITED}\n")
    _write(tmp_path, "sys/fs/cgroup/memory/kubepods/pod1/memory.limit_in_bytes", f"{6 * GiB}\n")
    _write(tmp_path, "sys/fs/cgroup/memory/kubepods/pod1/memory.usage_in_bytes", f"{5 * GiB}\n")
    memory = read_host_memory(root=str(tmp_path))
    assert (memory.cgroup_limit, memory.cgroup_usage) == (6 * GiB, 5 * GiB)
    assert memory.pin_limit == 6 * GiB
    assert memory.pin_limit_source == "cgroup v1 memory.limit_in_bytes"
    assert memory.headroom == 1 * GiB


def test_cgroup_v1_unlimited(tmp_path: Path) -> None:
    _proc(tmp_path, cgroup="4:memory:/\n")
    _write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", f"{V1_UNLIMITED}\n")
    _write(tmp_path, "sys/fs/cgroup/memory/memory.usage_in_bytes", f"{2 * GiB}\n")
    memory = read_host_memory(root=str(tmp_path))
    assert memory.cgroup_limit is None
    assert memory.cgroup_usage == 2 * GiB
    assert memory.pin_limit is None


def test_wsl_caps_pinning_at_half_of_ram(tmp_path: Path) -> None:
    _proc(tmp_path, release="5.15.153.1-microsoft-standard-WSL2")
    memory = read_host_memory(root=str(tmp_path))
    assert memory.wsl is True
    assert memory.pin_limit == 8 * GiB
    assert memory.pin_limit_source == "WSL (half of RAM)"


def test_wsl_from_proc_version(tmp_path: Path) -> None:
    _proc(tmp_path)
    (tmp_path / "proc/sys/kernel/osrelease").unlink()
    _write(tmp_path, "proc/version", "Linux version 4.4.0-19041-Microsoft (Microsoft@Microsoft.com)")
    assert read_host_memory(root=str(tmp_path)).wsl is True


def test_the_tightest_cap_wins(tmp_path: Path) -> None:
    # WSL's half of 16 GiB is 8 GiB; a 6 GiB cgroup limit is tighter.
    _proc(tmp_path, release="5.15.153.1-microsoft-standard-WSL2", cgroup="0::/c\n")
    _cgroup_v2(tmp_path, "c", {"memory.max": f"{6 * GiB}\n", "memory.current": "0\n"})
    memory = read_host_memory(root=str(tmp_path))
    assert (memory.pin_limit, memory.pin_limit_source) == (6 * GiB, "cgroup memory.max")


def test_missing_files_give_none_never_an_error(tmp_path: Path) -> None:
    memory = read_host_memory(root=str(tmp_path))
    assert memory == HostMemory(total=None, available=None, process_rss=None, cgroup_limit=None,
                                cgroup_usage=None, memlock_limit=8 * MiB, wsl=False,
                                pin_limit=None, pin_limit_source="none")
    assert memory.headroom is None


def test_garbled_files_give_none(tmp_path: Path) -> None:
    _write(tmp_path, "proc/meminfo", "MemTotal: lots\nnonsense\n")
    _write(tmp_path, "proc/self/cgroup", "garbage\n0::/x\n")
    _cgroup_v2(tmp_path, "x", {"memory.max": "12abc\n", "memory.current": "\n"})
    memory = read_host_memory(root=str(tmp_path))
    assert memory.total is None
    assert memory.cgroup_limit is None and memory.cgroup_usage is None


def test_headroom_never_negative() -> None:
    memory = HostMemory(total=16 * GiB, available=4 * GiB, cgroup_limit=2 * GiB,
                        cgroup_usage=3 * GiB)
    assert memory.headroom == 0
    assert HostMemory(total=None, available=None, cgroup_limit=2 * GiB,
                      cgroup_usage=GiB).headroom == GiB


def test_to_dict_is_json_serializable(tmp_path: Path) -> None:
    _proc(tmp_path, cgroup="0::/c\n")
    _cgroup_v2(tmp_path, "c", {"memory.max": f"{6 * GiB}\n", "memory.current": f"{GiB}\n"})
    memory = read_host_memory(root=str(tmp_path))
    data = json.loads(json.dumps(memory.to_dict()))
    assert data["headroom"] == 5 * GiB
    assert data["pin_limit_source"] == "cgroup memory.max"
    assert set(data) == {"total", "available", "process_rss", "cgroup_limit", "cgroup_usage",
                         "memlock_limit", "wsl", "pin_limit", "pin_limit_source", "headroom",
                         "shm_free", "shm_total"}
    assert "6.0 GiB (cgroup memory.max)" in str(memory)


def test_reads_this_machine_without_error() -> None:
    memory = read_host_memory()
    assert memory.pin_limit_source in ("cgroup memory.max", "cgroup v1 memory.limit_in_bytes",
                                       "WSL (half of RAM)", "none")
    if memory.total is not None:
        assert memory.total > 0
    json.dumps(memory.to_dict())


def test_memlock_limit_reads_the_process_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    resource = pytest.importorskip("resource")
    monkeypatch.undo()  # the real reader, not the autouse stand-in
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    expected = None if soft == resource.RLIM_INFINITY else soft
    assert host_module._memlock_limit() == expected


def test_dev_shm_room_is_read_and_absent_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/shm is where vramkit.distributed shares a node's swapped weights."""
    import os
    import types

    seen: list[str] = []

    def statvfs(path: str) -> object:
        seen.append(path)
        return types.SimpleNamespace(f_bavail=100, f_blocks=250, f_frsize=4096)

    monkeypatch.setattr(os, "statvfs", statvfs)
    info = host_module.read_host_memory()
    assert os.path.join("/", "dev", "shm") in seen
    assert (info.shm_free, info.shm_total) == (100 * 4096, 250 * 4096)
    assert info.to_dict()["shm_total"] == 250 * 4096

    def missing(path: str) -> object:
        raise FileNotFoundError(path)

    monkeypatch.setattr(os, "statvfs", missing)
    info = host_module.read_host_memory()
    assert info.shm_free is None and info.shm_total is None


def test_proportional_set_size_is_read_from_smaps_rollup(tmp_path: Path) -> None:
    from vramkit.devices.host import process_pss_bytes

    _write(tmp_path, "proc/self/smaps_rollup",
           "00400000-7fff [rollup]\nRss:   2048 kB\nPss:   1536 kB\nShared_Clean:  0 kB\n")
    assert process_pss_bytes(root=str(tmp_path)) == 1536 * 1024
    assert process_pss_bytes(pid=999999, root=str(tmp_path)) is None  # no such process
    pss = process_pss_bytes()  # this machine (Linux: a positive figure)
    assert pss is None or pss > 0


# -- where a swapper's masters live (choose_host_memory) ---------------------------------------


def _host(**kw: object) -> HostMemory:
    kw.setdefault("total", 64 << 30)
    kw.setdefault("available", 60 << 30)
    return HostMemory(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("host", "platform", "nbytes", "mode", "words"), [
    (_host(), "linux", 20 << 30, "pinned", "fit"),
    (_host(), "linux", 60 << 30, "pageable", "RAM"),                 # most of RAM: not locked
    (_host(wsl=True, pin_limit=32 << 30, pin_limit_source="WSL (half of RAM)"), "linux",
     1 << 30, "pageable", "WSL"),
    (_host(), "win32", 1 << 30, "pageable", "Windows"),
    (_host(pin_limit=8 << 30, pin_limit_source="cgroup memory.max"), "linux", 7 << 30,
     "pageable", "cgroup"),
    (_host(pin_limit=8 << 30, pin_limit_source="cgroup memory.max"), "linux", 6 << 30,
     "pinned", "cgroup"),
    (_host(pin_limit=8 << 30, pin_limit_source="cgroup memory.max"), "linux", None,
     "pinned", "larger ones pageable"),
    (_host(total=None, available=None), "linux", 1 << 40, "pinned", "no cap"),
])
def test_auto_host_memory(host: HostMemory, platform: str, nbytes: int | None, mode: str,
                          words: str) -> None:
    choice = choose_host_memory("auto", pinned_bytes=nbytes, host=host, platform=platform)
    assert choice.mode == mode and words in choice.reason
    assert str(choice).startswith(f"{mode}, because ")


def test_explicit_host_memory_is_kept() -> None:
    wsl = _host(wsl=True)
    assert choose_host_memory("pinned", host=wsl) == HostMemoryChoice(
        "pinned", "host_memory='pinned' was asked for")
    with pytest.raises(ValueError, match="host memory mode"):
        choose_host_memory("locked", host=wsl)
