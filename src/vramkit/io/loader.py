"""MemoryEfficientLoader: load safetensors checkpoints to a device without holding them twice.

Every method streams: tensors are read one at a time (or one chunk at a time for tensors larger
than a staging buffer) in file order, each straight into its final memory.

* To the CPU, bytes are read (memory map or ``pread``) into a fresh tensor; a dtype conversion,
  when asked, costs one extra tensor at a time.
* To a CUDA device, bytes go through double-buffered pinned staging buffers from the pinned
  pool while the previous chunk copies host->device on the shared copy stream, and dtype
  conversion runs on the GPU (:mod:`vramkit.io._staging`). The host never waits for a copy
  except to reuse a staging buffer.

``load_into`` fills a module built on the meta device (``torch.device("meta")``) by assigning
each loaded tensor in place of the meta one, so the module is never materialized twice; with
``quantization=`` each matching ``nn.Linear`` becomes a ``QuantizedLinear`` as soon as its
weight arrives, so the full-precision model never sits in memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vramkit.errors import ConfigError
from vramkit.io._header import TensorEntry
from vramkit.io.lazy import LazySafetensors, ReadThreads
from vramkit.units import parse_size

__all__ = ["LoadResult", "LoadStats", "MemoryEfficientLoader", "load_into", "stream_weights"]

logger = logging.getLogger(__name__)

_AUTO_PROGRESS_BYTES = 1 << 30  # progress=None shows a bar for loads of at least 1 GiB on a tty
_DEFAULT_CHUNK = 64 << 20


@dataclass(frozen=True)
class LoadStats:
    """What one load did.

    Args:
        tensors: tensors delivered.
        file_bytes: tensor bytes read from the files.
        h2d_bytes: bytes copied host->device (0 when loading to the CPU).
        seconds: wall time of the load.
        mode: ``"mmap"`` or ``"pread"``.
        staged: whether bytes went through pinned staging buffers (device loads).
        chunks: staging chunks used (0 for CPU loads).
    """

    tensors: int
    file_bytes: int
    h2d_bytes: int
    seconds: float
    mode: str
    staged: bool
    chunks: int = 0

    @property
    def gb_per_s(self) -> float:
        """File bytes per second, in GB/s (1e9)."""
        return self.file_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class LoadResult:
    """The outcome of :meth:`MemoryEfficientLoader.load_into`.

    Args:
        loaded_keys: module state-dict keys that were filled.
        missing_keys: module keys the checkpoint lacks (left as they were).
        unexpected_keys: checkpoint keys (under the prefix) the module has no place for.
        quantized_modules: qualified names of the ``nn.Linear`` layers replaced by
            ``QuantizedLinear``.
        still_meta: tensors of the module still on the meta device afterwards (missing keys or
            non-persistent buffers the caller must initialize).
        stats: the load's :class:`LoadStats`.
    """

    loaded_keys: list[str]
    missing_keys: list[str]
    unexpected_keys: list[str]
    quantized_modules: list[str]
    still_meta: list[str]
    stats: LoadStats


def _positive_size(name: str, value: int | str) -> int:
    try:
        size = parse_size(value) if isinstance(value, str) else value
    except ValueError as err:
        raise ConfigError(f"{name}: {err}") from None
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ConfigError(f"{name} must be a positive size, got {value!r}")
    return size


class MemoryEfficientLoader:
    """Loads safetensors checkpoints tensor by tensor onto a device.

    Args:
        device: where tensors go: ``"cpu"`` (default), ``"cuda"``, ``"cuda:N"`` or a
            ``torch.device``.
        dtype: convert floating-point tensors to this dtype while loading (on the GPU for CUDA
            devices); integer and bool tensors keep their stored dtype. ``None`` (default) keeps
            stored dtypes (``load_into`` then uses the module's own dtypes).
        use_mmap: read through a memory map (default ``True``) or with positional reads
            (``False``: network filesystems, files larger than RAM).
        chunk_bytes: size of each pinned staging buffer for device loads (default 64 MiB);
            larger tensors are copied in pieces of this size.
        num_buffers: staging buffers that rotate (default 2: one is read while the other copies).
        read_threads: threads that read each chunk in parallel (default ``min(8, cpu count)``).
        progress: show a rich progress bar (on stderr); ``None`` (default) shows one for loads of
            at least 1 GiB when stderr is a terminal, ``False`` never.
        pinned_pool: the pinned host pool staging buffers come from (default: a pool the loader
            creates on its first device load; it grows to ``num_buffers * chunk_bytes``).

    Raises:
        ConfigError: for an invalid argument.
    """

    def __init__(self, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 use_mmap: bool = True, *, chunk_bytes: int | str = _DEFAULT_CHUNK,
                 num_buffers: int = 2, read_threads: int | None = None,
                 progress: bool | None = None, pinned_pool: Any = None) -> None:
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise ConfigError(f"MemoryEfficientLoader: invalid device {device!r}: {err}") from None
        if self.device.type not in ("cpu", "cuda"):
            raise ConfigError(f"MemoryEfficientLoader loads to cpu or cuda, not "
                              f"{self.device.type!r}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ConfigError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
        if not isinstance(use_mmap, bool):
            raise ConfigError(f"use_mmap must be a bool, got {use_mmap!r}")
        self.chunk_bytes = _positive_size("chunk_bytes", chunk_bytes)
        if self.chunk_bytes % 16:
            raise ConfigError(f"chunk_bytes must be a multiple of 16, got {self.chunk_bytes}")
        if isinstance(num_buffers, bool) or not isinstance(num_buffers, int) or num_buffers < 1:
            raise ConfigError(f"num_buffers must be an int >= 1, got {num_buffers!r}")
        if read_threads is None:
            read_threads = max(1, min(8, os.cpu_count() or 1))
        if isinstance(read_threads, bool) or not isinstance(read_threads, int) or read_threads < 1:
            raise ConfigError(f"read_threads must be an int >= 1, got {read_threads!r}")
        if progress is not None and not isinstance(progress, bool):
            raise ConfigError(f"progress must be True, False or None, got {progress!r}")
        if pinned_pool is not None:
            from vramkit.memory.pool import MemoryPool

            if not isinstance(pinned_pool, MemoryPool) or pinned_pool.kind == "cuda":
                raise ConfigError(f"pinned_pool must be a host MemoryPool, got {pinned_pool!r}",
                                  hint="Pass MemoryPool.pinned(PoolConfig(...)).")
        self.dtype = dtype
        self.use_mmap = use_mmap
        self.num_buffers = num_buffers
        self.read_threads = read_threads
        self.progress = progress
        self._pinned_pool = pinned_pool
        self.last_stats: LoadStats | None = None

    # -- public verbs ---------------------------------------------------------------------

    def load_safetensors(self, path: str | os.PathLike[str], prefix: str | None = None,
                         strip_prefix: bool = False) -> dict[str, torch.Tensor]:
        """Load a checkpoint's tensors (all, or those whose names start with ``prefix``).

        Args:
            path: a file, a ``*.safetensors.index.json`` or a sharded directory.
            prefix: keep only names starting with this string (default: all).
            strip_prefix: drop the prefix from the returned names (default ``False``).

        Returns:
            name -> tensor on the loader's device.
        """
        out: dict[str, torch.Tensor] = {}
        cut = len(prefix) if (prefix and strip_prefix) else 0

        def keep(name: str, tensor: torch.Tensor) -> None:
            out[name[cut:]] = tensor

        self.stream_weights(path, keep, prefix=prefix)
        return out

    def load_with_dtype_conversion(self, path: str | os.PathLike[str],
                                   target_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Load every tensor, converting floating-point ones to ``target_dtype`` on the way.

        Args:
            path: a file, a ``*.safetensors.index.json`` or a sharded directory.
            target_dtype: a floating-point dtype (overrides the loader's ``dtype``).

        Returns:
            name -> tensor on the loader's device.
        """
        if not (isinstance(target_dtype, torch.dtype) and target_dtype.is_floating_point):
            raise ConfigError(f"target_dtype must be a floating-point torch.dtype, got "
                              f"{target_dtype!r}")
        out: dict[str, torch.Tensor] = {}
        with self._open(path) as checkpoint:
            self._stream(checkpoint, checkpoint.entries(), _floating_to(target_dtype),
                         out.__setitem__)
        return out

    def stream_weights(self, path: str | os.PathLike[str],
                       callback: Callable[[str, torch.Tensor], Any], *,
                       prefix: str | None = None) -> LoadStats:
        """Call ``callback(name, tensor)`` for every tensor, one at a time, in file order.

        Memory stays bounded: the loader keeps no reference to a tensor after the callback
        returns (device loads hold at most one staging chunk's tensors at once). For device
        loads the tensor is ready for work on the current stream; the host does not wait for it.

        Args:
            path: a file, a ``*.safetensors.index.json`` or a sharded directory.
            callback: receives each tensor's name and value.
            prefix: only tensors whose names start with this string (default: all).

        Returns:
            The load's :class:`LoadStats` (also kept as ``last_stats``).
        """
        with self._open(path) as checkpoint:
            names = [n for n in checkpoint.tensor_names() if prefix is None or n.startswith(prefix)]
            return self._stream(checkpoint, checkpoint.entries(names),
                                _floating_to(self.dtype), callback)

    def load_into(self, module: nn.Module, path: str | os.PathLike[str],
                  prefix: str | None = None, strict: bool = True,
                  quantization: Any = None) -> LoadResult:
        """Fill ``module``'s parameters and persistent buffers from a checkpoint.

        Each loaded tensor replaces the module's tensor (``assign`` semantics: a module built on
        the meta device is materialized tensor by tensor, never twice). Parameters keep their
        ``requires_grad``; tied parameters stay tied. Floating tensors take the loader's
        ``dtype`` when set, else the dtype the module's tensor has.

        Args:
            module: the module, typically built under ``torch.device("meta")``.
            path: a file, a ``*.safetensors.index.json`` or a sharded directory.
            prefix: checkpoint names start with this prefix (``"model."``), which is removed to
                form module keys; other names are ignored (default: none).
            strict: raise before loading anything when keys are missing or unexpected (default
                ``True``); with ``False`` load what matches and report the rest.
            quantization: a ``vramkit.quant.QuantizationConfig``: every ``nn.Linear`` (and
                ``nn.Conv2d`` with ``quantize_conv``) for which ``config.should_quantize(name,
                layer)`` holds is replaced by a ``QuantizedLinear`` / ``QuantizedConv2d`` built
                from ``quantize_tensor(weight, config.weight_format())`` as soon as its weight is
                loaded, with the fp8 GEMM where ``activations_dtype="fp8"`` allows it, as
                ``quantize_model`` would (default ``None``: no quantization). ``min_sqnr_db``
                is refused: it needs the full-precision weight after loading.

        Returns:
            A :class:`LoadResult`.

        Raises:
            ConfigError: for missing/unexpected keys with ``strict=True``, shape mismatches, or a
                quantization config that is not a ``QuantizationConfig``.
            SafetensorsFormatError: for a malformed checkpoint.
        """
        with self._open(path) as checkpoint:
            filler = _ModuleFiller(module, checkpoint, prefix=prefix, dtype=self.dtype,
                                  quantization=quantization, device=self.device)
            filler.check(strict)
            stats = self._stream(checkpoint, filler.entries, filler.dtype_for, filler.receive)
            return filler.finish(stats)

    # -- the streaming core ---------------------------------------------------------------

    @contextlib.contextmanager
    def _open(self, path: str | os.PathLike[str]) -> Iterator[LazySafetensors]:
        checkpoint = LazySafetensors.open(path, use_mmap=self.use_mmap)
        try:
            yield checkpoint
        finally:
            checkpoint.close()

    def _stream(self, checkpoint: LazySafetensors, entries: Sequence[TensorEntry],
                dtype_for: Callable[[TensorEntry], torch.dtype],
                deliver: Callable[[str, torch.Tensor], Any]) -> LoadStats:
        total = sum(entry.nbytes for entry in entries)
        began = time.perf_counter()
        with ReadThreads(self.read_threads) as threads, \
                _progress_bar(self._show_progress(total), total,
                              f"loading {checkpoint.source.name}") as advance:
            if self.device.type == "cuda":
                counts = self._stream_staged(checkpoint, entries, dtype_for, deliver, threads,
                                             advance)
            else:
                counts = self._stream_host(checkpoint, entries, dtype_for, deliver, threads,
                                           advance)
        tensors, file_bytes, h2d_bytes, chunks = counts
        stats = LoadStats(tensors=tensors, file_bytes=file_bytes, h2d_bytes=h2d_bytes,
                          seconds=time.perf_counter() - began,
                          mode="mmap" if self.use_mmap else "pread",
                          staged=self.device.type == "cuda", chunks=chunks)
        self.last_stats = stats
        logger.debug("loaded %d tensors (%d bytes) from %s in %.3f s (%s)", stats.tensors,
                     stats.file_bytes, checkpoint.source, stats.seconds, stats.mode)
        return stats

    def _stream_host(self, checkpoint: LazySafetensors, entries: Sequence[TensorEntry],
                     dtype_for: Callable[[TensorEntry], torch.dtype],
                     deliver: Callable[[str, torch.Tensor], Any], threads: ReadThreads,
                     advance: Callable[[int], None]) -> tuple[int, int, int, int]:
        count = read = 0
        for entry in entries:
            tensor = checkpoint.load_tensor(entry.name, threads=threads)
            read += entry.nbytes
            dtype = dtype_for(entry)
            if dtype != entry.dtype:
                tensor = tensor.to(dtype)
            deliver(entry.name, tensor)
            del tensor  # bounded memory: nothing of this tensor stays here
            count += 1
            advance(entry.nbytes)
        return count, read, 0, 0

    def _stream_staged(self, checkpoint: LazySafetensors, entries: Sequence[TensorEntry],
                       dtype_for: Callable[[TensorEntry], torch.dtype],
                       deliver: Callable[[str, torch.Tensor], Any], threads: ReadThreads,
                       advance: Callable[[int], None]) -> tuple[int, int, int, int]:
        from vramkit.io._staging import DeviceStager
        from vramkit.memory.transfer import resolve_offload_device, transfer_streams

        device = resolve_offload_device(self.device, "MemoryEfficientLoader")
        count = 0

        def counted(name: str, tensor: torch.Tensor) -> None:
            nonlocal count
            count += 1
            deliver(name, tensor)

        stager = DeviceStager(device, transfer_streams(device), self._staging_pool(),
                              chunk_bytes=self.chunk_bytes, num_buffers=self.num_buffers,
                              threads=threads)
        with torch.cuda.device(device):
            stager.load(checkpoint, entries, dtype_for, counted, advance)
        return count, stager.file_bytes, stager.h2d_bytes, stager.chunks

    def _staging_pool(self) -> Any:
        if self._pinned_pool is None:
            from vramkit.memory.pool import MemoryPool, PoolConfig

            # Grown by exactly what is asked (the staging buffers), then reused by later loads
            # through the pool's exact-size cache. No cap: a load that starts while the previous
            # one's last copies are still in flight finds those buffers pending and needs more.
            self._pinned_pool = MemoryPool.pinned(PoolConfig(growth_factor=1.0))
        return self._pinned_pool

    def _show_progress(self, total: int) -> bool:
        if self.progress is not None:
            return self.progress
        return total >= _AUTO_PROGRESS_BYTES and sys.stderr.isatty()


def _floating_to(dtype: torch.dtype | None) -> Callable[[TensorEntry], torch.dtype]:
    def dtype_for(entry: TensorEntry) -> torch.dtype:
        if dtype is not None and entry.dtype.is_floating_point:
            return dtype
        return entry.dtype

    return dtype_for


@contextlib.contextmanager
def _progress_bar(enabled: bool, total: int, description: str) -> Iterator[Callable[[int], None]]:
    if not enabled:
        yield lambda nbytes: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                        TransferSpeedColumn(), TimeRemainingColumn(),
                        console=Console(stderr=True), transient=False)
    task = progress.add_task(description, total=total)
    with progress:
        yield lambda nbytes: progress.advance(task, nbytes)


def stream_weights(path: str | os.PathLike[str], callback: Callable[[str, torch.Tensor], Any],
                   device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                   use_mmap: bool = True, *, prefix: str | None = None,
                   progress: bool | None = None) -> LoadStats:
    """Stream a checkpoint's tensors to ``callback`` one at a time (see
    :meth:`MemoryEfficientLoader.stream_weights`).

    Args:
        path: a file, a ``*.safetensors.index.json`` or a sharded directory.
        callback: receives ``(name, tensor)``.
        device: where tensors go (default ``"cpu"``).
        dtype: convert floating-point tensors to this dtype (default: keep).
        use_mmap: memory map (default) or positional reads.
        prefix: only tensors whose names start with it (default: all).
        progress: progress bar (default: automatic, see :class:`MemoryEfficientLoader`).

    Returns:
        The :class:`LoadStats`.
    """
    loader = MemoryEfficientLoader(device, dtype, use_mmap, progress=progress)
    return loader.stream_weights(path, callback, prefix=prefix)


def load_into(module: nn.Module, path: str | os.PathLike[str], prefix: str | None = None,
              strict: bool = True, quantization: Any = None, *,
              device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
              use_mmap: bool = True, progress: bool | None = None) -> LoadResult:
    """Fill a (meta-device) module from a checkpoint (see :meth:`MemoryEfficientLoader.load_into`).

    Args:
        module: the module to fill.
        path: a file, a ``*.safetensors.index.json`` or a sharded directory.
        prefix: checkpoint name prefix to strip (default: none).
        strict: refuse missing/unexpected keys (default ``True``).
        quantization: a ``QuantizationConfig`` to quantize Linear layers while loading.
        device: where tensors go (default ``"cpu"``).
        dtype: floating dtype to load as (default: the module's dtypes).
        use_mmap: memory map (default) or positional reads.
        progress: progress bar (default: automatic).

    Returns:
        A :class:`LoadResult`.
    """
    loader = MemoryEfficientLoader(device, dtype, use_mmap, progress=progress)
    return loader.load_into(module, path, prefix=prefix, strict=strict, quantization=quantization)



# -- load_into: filling a module -----------------------------------------------------------


def _quant_api() -> tuple[Any, Any, Any]:
    """``(QuantizationConfig, quantize_tensor, QuantizedLinear)`` from :mod:`vramkit.quant`."""
    import importlib

    try:
        package = importlib.import_module("vramkit.quant")
    except ImportError as err:
        raise ConfigError(f"load_into(quantization=...) needs vramkit.quant, which failed to "
                          f"import: {err}") from None
    found: list[Any] = []
    for name, homes in (("QuantizationConfig", ("model", "linear")),
                        ("quantize_tensor", ("formats",)),
                        ("QuantizedLinear", ("linear",))):
        value = getattr(package, name, None)
        for home in homes:
            if value is not None:
                break
            with contextlib.suppress(ImportError):
                value = getattr(importlib.import_module(f"vramkit.quant.{home}"), name, None)
        if value is None:
            raise ConfigError(f"vramkit.quant has no {name}; cannot quantize while loading")
        found.append(value)
    return found[0], found[1], found[2]


@dataclass
class _QuantPending:
    """A Linear being quantized: its weight arrives quantized, its bias as a tensor."""

    module_name: str
    has_bias: bool
    quantized: Any = None
    bias: torch.Tensor | None = None
    done: bool = False
    conv_geometry: dict[str, Any] | None = None  # set for a Conv2d
    activation_fp8: bool = False  # a Linear that runs the fp8 GEMM


class _ModuleFiller:
    """Maps checkpoint tensors to a module's slots and assigns them as they stream in."""

    def __init__(self, module: nn.Module, checkpoint: LazySafetensors, *, prefix: str | None,
                 dtype: torch.dtype | None, quantization: Any, device: torch.device) -> None:
        self.module = module
        self.dtype = dtype
        self.device = device
        state = module.state_dict(keep_vars=True)
        self.slots: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not key.endswith("_extra_state"):
                self.slots[key] = value
        # Tied tensors (one Parameter under several names) form one group, loaded once.
        by_id: dict[int, list[str]] = {}
        for key, value in self.slots.items():
            by_id.setdefault(id(value), []).append(key)
        self.aliases = {key: by_id[id(value)] for key, value in self.slots.items()}
        cut = len(prefix) if prefix else 0
        self.file_key: dict[str, str] = {}
        self.unexpected: list[str] = []
        for name in checkpoint.tensor_names():
            if prefix and not name.startswith(prefix):
                continue
            key = name[cut:]
            if key in self.slots:
                self.file_key[name] = key
            else:
                self.unexpected.append(key)
        present = set(self.file_key.values())
        self.missing = [key for key in self.slots
                        if not any(alias in present for alias in self.aliases[key])]
        self.entries = checkpoint.entries(list(self.file_key))
        mismatched = [f"{self.file_key[e.name]}: checkpoint {list(e.shape)}, module "
                      f"{list(self.slots[self.file_key[e.name]].shape)}" for e in self.entries
                      if tuple(self.slots[self.file_key[e.name]].shape) != e.shape]
        if mismatched:
            raise ConfigError(f"{len(mismatched)} tensor shape(s) differ between {checkpoint.source}"
                              f" and the module: " + "; ".join(mismatched[:5]),
                              hint="Build the module with the checkpoint's configuration.")
        self.loaded: list[str] = []
        self.quant: dict[str, _QuantPending] = {}
        self.weight_of: dict[str, _QuantPending] = {}
        self.bias_of: dict[str, _QuantPending] = {}
        self._quantize: Any = None
        self._format: Any = None
        self._quantized_linear: Any = None
        if quantization is not None:
            self._plan_quantization(quantization)

    def _plan_quantization(self, config: Any) -> None:
        config_type, self._quantize, self._quantized_linear = _quant_api()
        if not isinstance(config, config_type):
            raise ConfigError(f"quantization must be a {config_type.__name__}, got "
                              f"{type(config).__name__}")
        if getattr(config, "min_sqnr_db", None) is not None:
            raise ConfigError(
                "load_into(quantization=...) cannot apply min_sqnr_db: it quantizes each weight "
                "as it streams in, before a quality check could keep it in full precision",
                hint="Load in full precision and call quantize_model(model, config), or drop "
                     "min_sqnr_db.")
        self._format = config.weight_format()
        layer_types: tuple[type[nn.Module], ...] = (
            (nn.Linear, nn.Conv2d) if getattr(config, "quantize_conv", False) else (nn.Linear,))
        activation_fp8 = bool(getattr(config, "activation_fp8", False))
        for name, child in self.module.named_modules():
            if not isinstance(child, layer_types) or not config.should_quantize(name, child):
                continue
            weight_key = f"{name}.weight" if name else "weight"
            if len(self.aliases.get(weight_key, ())) > 1:
                logger.info("not quantizing %s: its weight is tied to %s", name,
                            self.aliases[weight_key])
                continue
            pending = _QuantPending(name, child.bias is not None)
            if isinstance(child, nn.Conv2d):
                from vramkit.quant.linear import conv_geometry

                pending.conv_geometry = conv_geometry(child)
            else:
                # As quantize_model does: the fp8 GEMM needs features divisible by 16, other
                # layers of an fp8-activation config run weight-only.
                pending.activation_fp8 = activation_fp8 and not (
                    child.in_features % 16 or child.out_features % 16)
            self.quant[name] = pending
            self.weight_of[weight_key] = pending
            if child.bias is not None:
                self.bias_of[f"{name}.bias" if name else "bias"] = pending

    def check(self, strict: bool) -> None:
        """Refuse (strict) or log missing and unexpected keys, before anything is loaded."""
        if not (self.missing or self.unexpected):
            return
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing key(s): {', '.join(self.missing[:8])}"
                         + (" ..." if len(self.missing) > 8 else ""))
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected key(s): "
                         f"{', '.join(self.unexpected[:8])}"
                         + (" ..." if len(self.unexpected) > 8 else ""))
        message = "the checkpoint does not match the module: " + "; ".join(parts)
        if strict:
            raise ConfigError(message, hint="Pass prefix= when the checkpoint nests the model "
                                            "under a name (e.g. 'model.'), or strict=False to "
                                            "load what matches.")
        logger.warning("%s (strict=False: loading what matches)", message)

    def dtype_for(self, entry: TensorEntry) -> torch.dtype:
        """The dtype a checkpoint tensor is loaded as."""
        if not entry.dtype.is_floating_point:
            return entry.dtype
        if self.dtype is not None:
            return self.dtype
        current = self.slots[self.file_key[entry.name]]
        return current.dtype if current.dtype.is_floating_point else entry.dtype

    def receive(self, name: str, tensor: torch.Tensor) -> None:
        """Place one loaded tensor (called by the stream, in file order)."""
        key = self.file_key[name]
        pending = self.weight_of.get(key)
        if pending is not None:
            # Quantized at once, so the full-precision weight is dropped before the next arrives.
            pending.quantized = self._quantize(tensor, self._format)
            del tensor
            self._finish_quantized(pending)
        elif key in self.bias_of:
            pending = self.bias_of[key]
            pending.bias = tensor
            self._finish_quantized(pending)
        else:
            self._assign(key, tensor)
        self.loaded.append(key)

    def _assign(self, key: str, tensor: torch.Tensor) -> None:
        current = self.slots[key]
        value: torch.Tensor = tensor
        if isinstance(current, nn.Parameter):
            value = nn.Parameter(tensor, requires_grad=current.requires_grad
                                 and (tensor.is_floating_point() or tensor.is_complex()))
        for alias in self.aliases[key]:
            owner_name, _, attr = alias.rpartition(".")
            owner = self.module.get_submodule(owner_name) if owner_name else self.module
            setattr(owner, attr, value)

    def _finish_quantized(self, pending: _QuantPending) -> None:
        if pending.quantized is None or (pending.has_bias and pending.bias is None):
            return
        parent_name, _, child = pending.module_name.rpartition(".")
        parent = self.module.get_submodule(parent_name) if parent_name else self.module
        if pending.conv_geometry is not None:
            from vramkit.quant.linear import QuantizedConv2d

            layer = QuantizedConv2d.from_quantized(pending.quantized, pending.bias,
                                                   **pending.conv_geometry)
        elif pending.activation_fp8:
            layer = self._quantized_linear.from_quantized(pending.quantized, pending.bias,
                                                          activation_fp8=True)
        else:
            layer = self._quantized_linear.from_quantized(pending.quantized, pending.bias)
        setattr(parent, child, layer)
        pending.quantized = pending.bias = None
        pending.done = True

    def finish(self, stats: LoadStats) -> LoadResult:
        """Check that every quantized layer was completed and build the result."""
        unfinished = [p.module_name for p in self.quant.values()
                      if not p.done and (p.quantized is not None or p.bias is not None)]
        if unfinished:
            raise ConfigError(f"cannot quantize {', '.join(unfinished)}: the checkpoint holds only "
                              "part of the layer (weight or bias missing)",
                              hint="Load with strict=True to see which keys are missing.")
        still_meta = [name for name, t in (*self.module.named_parameters(),
                                           *self.module.named_buffers()) if t.is_meta]
        if still_meta:
            logger.warning("%d tensor(s) are still on the meta device after loading (e.g. %s): "
                           "initialize them before use", len(still_meta), still_meta[0])
        return LoadResult(loaded_keys=self.loaded, missing_keys=self.missing,
                          unexpected_keys=self.unexpected,
                          quantized_modules=[p.module_name for p in self.quant.values() if p.done],
                          still_meta=still_meta, stats=stats)
