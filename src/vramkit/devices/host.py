"""Host memory as this process meets it: RAM, its own footprint, its cgroup, and the pinning cap.

:func:`read_host_memory` reads, without a subprocess and without raising for what is missing:

* ``/proc/meminfo``: ``MemTotal`` and ``MemAvailable`` (what the kernel could hand out without
  swapping);
* ``/proc/self/status``: ``VmRSS``, this process's resident set;
* ``/proc/sys/kernel/osrelease`` (or ``/proc/version``): a kernel built by Microsoft is WSL 2;
* the process's memory cgroup, from ``/proc/self/cgroup``: cgroup v2 ``memory.max`` /
  ``memory.current`` under ``/sys/fs/cgroup`` (when that is a unified mount), else v1
  ``memory.limit_in_bytes`` / ``memory.usage_in_bytes`` under ``/sys/fs/cgroup/memory``. The
  cgroup and each ancestor up to the mount are read, and the smallest limit among them is the
  one in effect (a container sees its own cgroup as the mount's root);
* ``resource.getrlimit(RLIMIT_MEMLOCK)``, where the ``resource`` module exists (not on
  Windows).

Where ``/proc`` is missing (macOS, Windows) and psutil is installed, total, available and the
resident set come from psutil, as :func:`vramkit.devices.memory_info.read_memory_info` reads the
host.

Pinned (page-locked) host memory, which every fast host<->device copy needs, is capped by:

* the cgroup limit: pinned pages are charged to the cgroup like any other page, and they cannot
  be reclaimed or swapped, so going past ``memory.max`` gets the process OOM-killed: no error
  comes back from the pinning call;
* WSL 2: the GPU paravirtualization layer caps page-locked memory at about half of the VM's
  RAM;
* not ``RLIMIT_MEMLOCK``, for CUDA: the NVIDIA driver pins with ``get_user_pages`` (both
  ``cudaHostAlloc`` and ``cudaHostRegister``; ``os_lock_user_pages`` in its kernel module) and
  does not charge the pages against the limit, which is why PyTorch pins gigabytes under the
  64 KiB / 8 MiB default of containers and distributions. The limit does apply to ``mlock``,
  io_uring buffers and RDMA registration (GPUDirect, NCCL over InfiniBand); it is reported
  (:attr:`HostMemory.memlock_limit`) but not taken as a cap on CUDA pinning.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any

from vramkit.units import format_size

__all__ = ["HOST_MEMORY_MODES", "HostMemory", "HostMemoryChoice", "choose_host_memory",
           "filesystem_room", "process_pss_bytes", "read_host_memory"]

# Where a block swapper keeps its masters: page-locked ("pinned"), ordinary memory copied through
# a small pinned pool ("pageable"), or chosen for this machine ("auto": choose_host_memory).
HOST_MEMORY_MODES = ("pinned", "pageable", "auto")
# "auto" pins the masters while they take at most this share of the pinning cap: the rest of the
# process (and, under a cgroup, its page cache) needs room too, and pinned pages cannot be
# reclaimed.
PIN_SHARE = 0.8

# cgroup v1 writes "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 on 4 KiB pages);
# anything this large is no limit.
_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class HostMemory:
    """This process's host memory, in bytes; ``None`` = not known (or no limit, for limits).

    Attributes:
        total: RAM the kernel manages (``MemTotal``; a WSL 2 or container VM's own RAM).
        available: memory the kernel could still hand out without swapping (``MemAvailable``).
        process_rss: this process's resident set (``VmRSS``).
        cgroup_limit: the memory limit of this process's cgroup, the smallest of it and its
            ancestors (v2 ``memory.max``, v1 ``memory.limit_in_bytes``); ``None`` when there
            is none or no memory cgroup can be read.
        cgroup_usage: the memory charged to that cgroup (v2 ``memory.current``, v1
            ``memory.usage_in_bytes``): every process in it, page cache included.
        memlock_limit: the soft ``RLIMIT_MEMLOCK``; ``None`` = unlimited or unknown. Not a cap
            on CUDA pinned memory (see the module docstring): it applies to ``mlock``, io_uring
            and RDMA registration.
        wsl: the kernel is WSL 2's.
        pin_limit: the tightest known cap on page-locked memory this process can hold: the
            cgroup limit (when below ``total``; exceeding it is an OOM kill, not an error) or,
            on WSL, half of ``total``; ``None`` when neither applies (RAM itself, minus what
            else needs it, is then the bound).
        shm_free / shm_total: free and total bytes of ``/dev/shm`` (the tmpfs
            ``vramkit.distributed`` shares a node's swapped weights in; Docker gives it 64 MiB
            unless ``--shm-size``), ``None`` where there is none.
        pin_limit_source: where ``pin_limit`` comes from: ``"cgroup memory.max"``,
            ``"cgroup v1 memory.limit_in_bytes"``, ``"WSL (half of RAM)"`` or ``"none"``.
    """

    total: int | None
    available: int | None
    process_rss: int | None = None
    cgroup_limit: int | None = None
    cgroup_usage: int | None = None
    memlock_limit: int | None = None
    wsl: bool = False
    pin_limit: int | None = None
    pin_limit_source: str = "none"
    shm_free: int | None = None
    shm_total: int | None = None

    @property
    def headroom(self) -> int | None:
        """Bytes this process can still commit before the tighter of ``MemAvailable`` and the
        cgroup's room (``cgroup_limit - cgroup_usage``); ``None`` when neither is known."""
        candidates = [v for v in (self.available,) if v is not None]
        if self.cgroup_limit is not None and self.cgroup_usage is not None:
            candidates.append(self.cgroup_limit - self.cgroup_usage)
        return max(0, min(candidates)) if candidates else None

    def to_dict(self) -> dict[str, Any]:
        """The fields and ``headroom``, as JSON-ready data."""
        data = dataclasses.asdict(self)
        data["headroom"] = self.headroom
        return data

    def __str__(self) -> str:
        def size(value: int | None) -> str:
            return "n/a" if value is None else format_size(value)

        pin = ("no cap known" if self.pin_limit is None
               else f"{format_size(self.pin_limit)} ({self.pin_limit_source})")
        return (f"host RAM {size(self.total)} ({size(self.available)} available), this process "
                f"{size(self.process_rss)}, headroom {size(self.headroom)}, pinning {pin}")


# -- reading files -----------------------------------------------------------------------------


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except (OSError, ValueError):
        return None


def _kib_fields(text: str | None, names: tuple[str, ...]) -> dict[str, int]:
    """``Name:   1234 kB`` lines of ``/proc/meminfo`` or ``/proc/self/status``, in bytes."""
    found: dict[str, int] = {}
    for line in (text or "").splitlines():
        key, _, rest = line.partition(":")
        if key not in names:
            continue
        parts = rest.split()
        if not parts or not parts[0].isdigit():
            continue
        unit = parts[1].lower() if len(parts) > 1 else ""
        found[key] = int(parts[0]) * (1024 if unit == "kb" else 1)
    return found


def _read_int(path: str) -> int | None:
    """A cgroup value file: an integer, or ``None`` for ``max``, missing or garbled files."""
    text = _read_text(path)
    if text is None:
        return None
    text = text.strip()
    return int(text) if text.isdigit() else None


def _is_wsl(root: str) -> bool:
    for name in ("proc/sys/kernel/osrelease", "proc/version"):
        text = _read_text(os.path.join(root, name))
        if text is not None:
            return "microsoft" in text.lower() or "wsl" in text.lower()
    return False


def _cgroup_paths(root: str) -> tuple[str | None, str | None]:
    """``(v2 path, v1 memory path)`` of this process's cgroups, from ``/proc/self/cgroup``."""
    v2: str | None = None
    v1: str | None = None
    for line in (_read_text(os.path.join(root, "proc/self/cgroup")) or "").splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _levels(mount: str, path: str) -> list[str]:
    """The cgroup directory of ``path`` under ``mount`` and its ancestors up to the mount.

    Without a cgroup namespace a container's ``/proc/self/cgroup`` names the host's path while
    the mount shows the container's own cgroup as its root: a path that is not there is read
    at the mount's root.
    """
    relative = os.path.normpath("/" + path).lstrip("/")
    if relative in ("", ".") or relative.startswith(".."):
        return [mount]
    directory = os.path.join(mount, relative)
    if not os.path.isdir(directory):
        return [mount]
    levels = [directory]
    while directory != mount and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)
        levels.append(directory)
    return levels


def _tightest(levels: list[str], limit_file: str, usage_file: str
              ) -> tuple[int | None, int | None]:
    """``(limit, usage)`` at the level whose limit is smallest; the process's own cgroup's usage
    when no level has a limit."""
    best: tuple[int, int | None] | None = None
    for level in levels:
        limit = _read_int(os.path.join(level, limit_file))
        if limit is None or limit >= _UNLIMITED:
            continue
        if best is None or limit < best[0]:
            best = (limit, _read_int(os.path.join(level, usage_file)))
    if best is not None:
        return best
    return None, _read_int(os.path.join(levels[0], usage_file))


def _read_cgroup(root: str) -> tuple[int | None, int | None, str | None]:
    """``(limit, usage, version name)`` of this process's memory cgroup."""
    v2_path, v1_path = _cgroup_paths(root)
    mount = os.path.join(root, "sys/fs/cgroup")
    # A unified (v2-only) mount has cgroup.controllers at its root; on a hybrid system the v2
    # tree lives in /sys/fs/cgroup/unified and holds no memory controller.
    if v2_path is not None and os.path.isfile(os.path.join(mount, "cgroup.controllers")):
        limit, usage = _tightest(_levels(mount, v2_path), "memory.max", "memory.current")
        return limit, usage, "cgroup memory.max"
    if v1_path is not None:
        v1_mount = os.path.join(mount, "memory")
        if os.path.isdir(v1_mount):
            limit, usage = _tightest(_levels(v1_mount, v1_path), "memory.limit_in_bytes",
                                     "memory.usage_in_bytes")
            return limit, usage, "cgroup v1 memory.limit_in_bytes"
    return None, None, None


def _memlock_limit() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    try:
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (OSError, ValueError, AttributeError):
        return None
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    return int(soft)


def _psutil_fallback() -> tuple[int | None, int | None, int | None]:
    try:
        import psutil
    except ImportError:
        return None, None, None
    try:
        memory = psutil.virtual_memory()
        rss = psutil.Process().memory_info().rss
    except Exception:  # psutil raises its own errors for unsupported platforms
        return None, None, None
    return int(memory.total), int(memory.available), int(rss)


# -- the reader --------------------------------------------------------------------------------


def read_host_memory(*, root: str = "/") -> HostMemory:
    """Read this process's host memory now (a few small file reads; no subprocess).

    Args:
        root: where ``proc/``, ``sys/fs/cgroup/`` and ``dev/shm`` are looked for (default
            ``"/"``); tests point it at a fake tree. ``RLIMIT_MEMLOCK`` is always this process's, and psutil
            stands in for a missing ``/proc/meminfo`` only when ``root`` is ``"/"``.

    Returns:
        A :class:`HostMemory`; what cannot be read is ``None`` (never an error).
    """
    proc = os.path.join(root, "proc")
    meminfo = _kib_fields(_read_text(os.path.join(proc, "meminfo")), ("MemTotal",
                                                                      "MemAvailable"))
    status = _kib_fields(_read_text(os.path.join(proc, "self/status")), ("VmRSS",))
    total, available = meminfo.get("MemTotal"), meminfo.get("MemAvailable")
    rss = status.get("VmRSS")
    if total is None and os.path.abspath(root) == os.path.abspath(os.sep):
        total, available, psutil_rss = _psutil_fallback()
        rss = rss if rss is not None else psutil_rss
    wsl = _is_wsl(root)
    cgroup_limit, cgroup_usage, cgroup_source = _read_cgroup(root)

    candidates: list[tuple[int, str]] = []
    if cgroup_limit is not None and cgroup_source is not None and (
            total is None or cgroup_limit < total):
        candidates.append((cgroup_limit, cgroup_source))
    if wsl and total is not None:
        candidates.append((total // 2, "WSL (half of RAM)"))
    pin_limit, pin_source = min(candidates) if candidates else (None, "none")
    shm_free, shm_total = filesystem_room(os.path.join(root, "dev", "shm"))
    return HostMemory(total=total, available=available, process_rss=rss,
                      cgroup_limit=cgroup_limit, cgroup_usage=cgroup_usage,
                      memlock_limit=_memlock_limit(), wsl=wsl, pin_limit=pin_limit,
                      pin_limit_source=pin_source, shm_free=shm_free, shm_total=shm_total)


@dataclass(frozen=True)
class HostMemoryChoice:
    """Where a swapper's masters live here, and why (:func:`choose_host_memory`).

    Attributes:
        mode: ``"pinned"`` (page-locked masters, the fastest copies) or ``"pageable"``
            (ordinary memory, copied through a small pinned staging pool on a worker thread).
        reason: why, in words (``"... because <reason>"``).
    """

    mode: str
    reason: str

    def __str__(self) -> str:
        return f"{self.mode}, because {self.reason}"


def choose_host_memory(requested: str = "auto", *, pinned_bytes: int | None = None,
                       host: HostMemory | None = None,
                       platform: str | None = None) -> HostMemoryChoice:
    """Resolve ``SwapConfig.host_memory`` for this machine.

    ``"auto"`` chooses pageable masters on Windows and WSL 2 (the display driver model charges
    page-locked memory as "shared GPU memory" and caps it near half of RAM; pinning a whole model
    there made steps slower), and where the masters (``pinned_bytes``) would take more than
    ``PIN_SHARE`` of the pinning cap in effect (a cgroup limit: pinned pages past it are an OOM
    kill); pinned masters otherwise.

    Args:
        requested: ``"pinned"``, ``"pageable"`` or ``"auto"``.
        pinned_bytes: the bytes that would be pinned (``None``: not known yet, e.g.
            ``vramkit info``; then only the platform decides, and the cap is stated).
        host: the host memory reading (default: :func:`read_host_memory` now).
        platform: ``sys.platform`` stand-in (tests).
    """
    if requested not in HOST_MEMORY_MODES:
        raise ValueError(f"host memory mode must be one of {HOST_MEMORY_MODES}, got "
                         f"{requested!r}")
    if requested != "auto":
        return HostMemoryChoice(requested, f"host_memory={requested!r} was asked for")
    if (platform or sys.platform) == "win32":
        return HostMemoryChoice("pageable", "this is Windows: pinned memory counts as shared "
                                            "GPU memory under its display driver model")
    host = read_host_memory() if host is None else host
    if host.wsl:
        return HostMemoryChoice("pageable", "this is WSL 2: pinned memory counts as shared GPU "
                                            "memory under Windows' display driver model and is "
                                            "capped near half of RAM")
    # Without a cap, RAM itself bounds pinning: locked pages cannot be swapped out, and the
    # system needs the rest.
    cap, source = ((host.pin_limit, host.pin_limit_source) if host.pin_limit is not None
                   else (host.total, "RAM") if host.total is not None else (None, "none"))
    if cap is None:
        return HostMemoryChoice("pinned", "no cap on pinned memory is known here")
    allowed = int(cap * PIN_SHARE)
    if pinned_bytes is None:
        return HostMemoryChoice(
            "pinned", f"pinning is bounded by {format_size(cap)} ({source}): masters up to "
                      f"{format_size(allowed)} are pinned, larger ones pageable")
    if pinned_bytes > allowed:
        return HostMemoryChoice(
            "pageable", f"the masters ({format_size(pinned_bytes)}) exceed {PIN_SHARE:.0%} of "
                        f"the {format_size(cap)} pinning can take ({source})")
    return HostMemoryChoice(
        "pinned", f"the masters ({format_size(pinned_bytes)}) fit {PIN_SHARE:.0%} of the "
                  f"{format_size(cap)} pinning can take ({source})")


def filesystem_room(path: str) -> tuple[int | None, int | None]:
    """(free, total) bytes of the filesystem at ``path`` (``/dev/shm``: RAM a tmpfs may still
    take); ``(None, None)`` when it is absent."""
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):  # no such directory; no statvfs (Windows)
        return None, None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def process_pss_bytes(pid: int | str = "self", *, root: str = "/") -> int | None:
    """A process's proportional set size: resident pages, each shared page divided by the
    number of processes mapping it (``/proc/<pid>/smaps_rollup``). Summed over a node's ranks,
    memory they share (``vramkit.distributed``'s masters) counts once.

    Returns:
        Bytes, or ``None`` where ``/proc`` does not give it (not Linux, old kernels).
    """
    text = _read_text(os.path.join(root, "proc", str(pid), "smaps_rollup"))
    return _kib_fields(text, ("Pss",)).get("Pss")
