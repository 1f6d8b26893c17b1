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
each loaded tensor in place of the meta one, so the module is never materialized twice. The
non-persistent buffers checkpoints never hold (rotary ``inv_freq``...) are recomputed where the
model offers a way (transformers' ``_init_weights``, :mod:`vramkit.io._buffers`); what stays on
meta is listed in ``LoadResult.still_meta`` and in a warning. With
``quantization=`` each layer :func:`vramkit.quant.model.quantizable_layers` selects becomes a
``QuantizedLinear`` / ``QuantizedConv2d`` as soon as its weight arrives, so the full-precision
model never sits in memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vramkit._validate import check_bool, check_device, check_int, check_size
from vramkit.errors import ConfigError
from vramkit.io._buffers import meta_non_persistent_buffers, recompute_meta_buffers
from vramkit.io._header import TensorEntry
from vramkit.io.adapters import adapter_keys, init_meta_adapters, peft_base_key
from vramkit.io.formats import describe_names, model_prefix, open_checkpoint, prepare_module
from vramkit.io.lazy import LazySafetensors, ReadThreads

if TYPE_CHECKING:  # imported on use (see ModuleFiller._plan_quantization)
    from vramkit.quant.model import QuantizationConfig

__all__ = ["LoadResult", "LoadStats", "MemoryEfficientLoader", "load_into", "stream_weights"]

logger = logging.getLogger(__name__)

_AUTO_PROGRESS_BYTES = 1 << 30  # progress=None shows a bar for loads of at least 1 GiB on a tty
_DEFAULT_CHUNK = 64 << 20
_CHUNK_MULTIPLE = 16  # the staging alignment: pieces split on 16-byte boundaries (io._staging)


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
        quantized_modules: qualified names of the layers replaced by ``QuantizedLinear`` /
            ``QuantizedConv2d``.
        still_meta: tensors of the module still on the meta device afterwards (missing keys, or
            non-persistent buffers the module offers no way to recompute), which the caller
            must set before using the module; a warning names each of them.
        stats: the load's :class:`LoadStats`.
        initialized_buffers: non-persistent buffers (never in checkpoints) that were on meta and
            were recomputed on the weights' device with the model's own initializer
            (transformers' ``_init_weights``: rotary ``inv_freq``, position ids).
    """

    loaded_keys: list[str]
    missing_keys: list[str]
    unexpected_keys: list[str]
    quantized_modules: list[str]
    still_meta: list[str]
    stats: LoadStats
    initialized_buffers: list[str] = field(default_factory=list)


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
        # The form only: whether a CUDA device is there is asked when a load starts.
        self.device: torch.device = check_device("MemoryEfficientLoader device", device)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ConfigError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}",
                              hint="Pass a floating-point dtype such as torch.bfloat16 or "
                                   "torch.float16, or None to keep each tensor's stored dtype.")
        check_bool("use_mmap", use_mmap)
        self.chunk_bytes: int = check_size("chunk_bytes", chunk_bytes, minimum=1)
        if self.chunk_bytes % _CHUNK_MULTIPLE:
            raise ConfigError(f"chunk_bytes must be a multiple of {_CHUNK_MULTIPLE}, got "
                              f"{self.chunk_bytes}", hint="Use a power of two, e.g. '64MiB'.")
        check_int("num_buffers", num_buffers, minimum=1)
        if read_threads is None:
            read_threads = max(1, min(8, os.cpu_count() or 1))
        check_int("read_threads", read_threads, minimum=1)
        check_bool("progress", progress, allow_none=True)
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
                              f"{target_dtype!r}",
                              hint="Pass target_dtype as a floating-point torch.dtype, e.g. "
                                   "target_dtype=torch.bfloat16.")
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
                  quantization: QuantizationConfig | None = None, *,
                  skip: Sequence[str] = ()) -> LoadResult:
        """Fill ``module``'s parameters and persistent buffers from a checkpoint.

        Each loaded tensor replaces the module's tensor (``assign`` semantics: a module built on
        the meta device is materialized tensor by tensor, never twice). Parameters keep their
        ``requires_grad``; tied parameters stay tied. Floating tensors take the loader's
        ``dtype`` when set, else the dtype the module's tensor has.

        Non-persistent buffers (which checkpoints never hold) still on meta afterwards are
        recomputed on the weights' device where the model offers a way: a ``transformers``
        model's ``_init_weights`` (rotary ``inv_freq``, position ids), run with every loaded
        tensor hidden behind a meta stand-in so it cannot overwrite them. The rest stays on meta,
        listed in ``LoadResult.still_meta`` and named in a warning.

        Args:
            module: the module, typically built under ``torch.device("meta")``.
            path: a file, a ``*.safetensors.index.json`` or a sharded directory.
            prefix: checkpoint names start with this prefix (``"model."``), which is removed to
                form module keys; other names are ignored (default: none).
            strict: raise before loading anything when keys are missing or unexpected (default
                ``True``); with ``False`` load what matches and report the rest.
            quantization: a :class:`vramkit.quant.model.QuantizationConfig`: every layer
                :func:`~vramkit.quant.model.quantizable_layers` selects is replaced as soon as
                its weight is loaded, by the layer :func:`~vramkit.quant.model.quantized_layer`
                builds, as ``quantize_model`` would (default ``None``: no quantization). A
                layer whose weight the checkpoint names more than once (a module registered
                twice) is loaded in full precision. ``min_sqnr_db`` is refused: it needs the
                full-precision weight after loading.
            skip: qualified names of submodules filled another way: the file's keys under them
                are neither read nor required.

        Returns:
            A :class:`LoadResult`.

        Raises:
            ConfigError: for missing/unexpected keys with ``strict=True``, shape mismatches, or a
                quantization config that is not a ``QuantizationConfig``.
            SafetensorsFormatError: for a malformed checkpoint.
        """
        with self._open(path) as checkpoint:
            prefix = model_prefix(checkpoint, prefix)
            # Layers whose weights the file keeps packed (GGUF, fp8_scaled kept in fp8) are
            # replaced on meta first, so their packed buffers are what the file fills.
            prepared = prepare_module(module, checkpoint, quantization, self.device,
                                      prefix=prefix)
            if prepared:
                logger.info("%d layer(s) keep the file's packed weights: %s", len(prepared),
                            _listed(prepared))
            filler = ModuleFiller(module, checkpoint, prefix=prefix, dtype=self.dtype,
                                  quantization=quantization, device=self.device, skip=skip)
            filler.check(strict)
            stats = self._stream(checkpoint, filler.entries, filler.dtype_for, filler.receive)
            return filler.finish(stats)

    def stream_entries(self, checkpoint: LazySafetensors, entries: Sequence[TensorEntry],
                       deliver: Callable[[str, torch.Tensor], Any],
                       dtype_for: Callable[[TensorEntry], torch.dtype] | None = None
                       ) -> LoadStats:
        """Stream chosen tensors of an open checkpoint (for callers that place tensors
        themselves, such as a swapper filling a model built on meta).

        Args:
            checkpoint: an open :class:`~vramkit.io.lazy.LazySafetensors` (not closed here).
            entries: the tensors to load (:meth:`LazySafetensors.entries`), read in this order.
            deliver: ``deliver(name, tensor)`` for each, on the loader's device.
            dtype_for: the dtype each tensor is delivered as (default: the loader's ``dtype``
                for floating tensors, else the stored one).

        Returns:
            The load's :class:`LoadStats`.
        """
        return self._stream(checkpoint, entries,
                            dtype_for if dtype_for is not None else _floating_to(self.dtype),
                            deliver)

    # -- the streaming core ---------------------------------------------------------------

    @contextlib.contextmanager
    def _open(self, path: str | os.PathLike[str]) -> Iterator[LazySafetensors]:
        # The one door: safetensors as they are, single-file layouts, fp8_scaled and GGUF files
        # with the model's names (vramkit.io.formats).
        checkpoint = open_checkpoint(path, use_mmap=self.use_mmap)
        try:
            yield checkpoint
        finally:
            checkpoint.close()

    def _stream(self, checkpoint: LazySafetensors, entries: Sequence[TensorEntry],
                dtype_for: Callable[[TensorEntry], torch.dtype],
                deliver: Callable[[str, torch.Tensor], Any]) -> LoadStats:
        total = sum(entry.nbytes for entry in entries)
        began = time.perf_counter()
        with (ReadThreads(self.read_threads) as threads,
              progress_bar(self._show_progress(total), total,
                            f"loading {checkpoint.source.name}") as advance):
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
        from vramkit.devices.resolve import resolve_device
        from vramkit.io._staging import DeviceStager
        from vramkit.memory.transfer import transfer_streams

        device = resolve_device(self.device, owner="MemoryEfficientLoader")
        count = 0

        def counted(name: str, tensor: torch.Tensor) -> None:
            nonlocal count
            count += 1
            deliver(name, tensor)

        # Tensors that need work after reading (vramkit.io.formats: fp8 scales, swapped halves)
        # are read through the checkpoint's load_tensor, then copied; the rest is staged.
        fixed = getattr(checkpoint, "fixed_names", frozenset())
        read_bytes = 0
        if fixed:
            for entry in [e for e in entries if e.name in fixed]:
                value = checkpoint.load_tensor(entry.name, threads=threads)
                counted(entry.name, value.to(device=device, dtype=dtype_for(entry)))
                read_bytes += entry.nbytes
                advance(entry.nbytes)
            entries = [e for e in entries if e.name not in fixed]
        stager = DeviceStager(device, transfer_streams(device), self._staging_pool(),
                              chunk_bytes=self.chunk_bytes, num_buffers=self.num_buffers,
                              threads=threads)
        with torch.cuda.device(device):
            stager.load(checkpoint, entries, dtype_for, counted, advance)
        return (count, stager.file_bytes + read_bytes, stager.h2d_bytes + read_bytes,
                stager.chunks)

    def _staging_pool(self) -> Any:
        if self._pinned_pool is None:
            from vramkit.memory.pool import MemoryPool, PoolConfig

            # Grown by exactly what is asked (the staging buffers), then reused by later loads
            # through the pool's exact-size cache. No cap: a load that starts while the previous
            # one's last copies are still in flight finds those buffers pending and needs more.
            self._pinned_pool = MemoryPool.pinned(PoolConfig(growth_factor=1.0))
        return self._pinned_pool

    def _show_progress(self, total: int) -> bool:
        return show_progress(self.progress, total)


def _floating_to(dtype: torch.dtype | None) -> Callable[[TensorEntry], torch.dtype]:
    def dtype_for(entry: TensorEntry) -> torch.dtype:
        if dtype is not None and entry.dtype.is_floating_point:
            return dtype
        return entry.dtype

    return dtype_for


def show_progress(progress: bool | None, total: int) -> bool:
    """Whether a load of ``total`` bytes shows a bar: ``progress`` when set, else for loads of at
    least 1 GiB when stderr is a terminal."""
    if progress is not None:
        return progress
    return total >= _AUTO_PROGRESS_BYTES and sys.stderr.isatty()


@contextlib.contextmanager
def progress_bar(enabled: bool, total: int, description: str) -> Iterator[Callable[[int], None]]:
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
              strict: bool = True, quantization: QuantizationConfig | None = None, *,
              device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
              use_mmap: bool = True, progress: bool | None = None) -> LoadResult:
    """Fill a (meta-device) module from a checkpoint (see :meth:`MemoryEfficientLoader.load_into`).

    Args:
        module: the module to fill.
        path: a file, a ``*.safetensors.index.json`` or a sharded directory.
        prefix: checkpoint name prefix to strip (default: none).
        strict: refuse missing/unexpected keys (default ``True``).
        quantization: a ``QuantizationConfig`` to quantize Linear/Conv2d layers while loading.
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


@dataclass
class _QuantPending:
    """A layer being quantized: its weight arrives quantized, its bias as a tensor."""

    module_name: str
    layer: nn.Module  # the (meta) layer replaced
    has_bias: bool
    quantized: Any = None
    bias: torch.Tensor | None = None
    done: bool = False


class ModuleFiller:
    """Maps checkpoint tensors to a module's slots and assigns them as they stream in."""

    def __init__(self, module: nn.Module, checkpoint: LazySafetensors, *, prefix: str | None,
                 dtype: torch.dtype | None, quantization: Any, device: torch.device,
                 skip: Sequence[str] = ()) -> None:
        self.module = module
        self.checkpoint = checkpoint
        prefix = model_prefix(checkpoint, prefix)
        self.dtype = dtype
        self.device = device
        # Submodules filled another way: their keys are neither read nor expected.
        skipped = tuple(f"{name}." for name in skip)
        state = module.state_dict(keep_vars=True)
        # Tensors a checkpoint format filled itself (vramkit.io.formats.prepare_module).
        prefilled = getattr(checkpoint, "prefilled", set())
        self.slots: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            if (isinstance(value, torch.Tensor) and not key.endswith("_extra_state")
                    and not key.startswith(skipped) and key not in prefilled):
                self.slots[key] = value
        # Tied tensors (one Parameter under several names) form one group, loaded once.
        by_id: dict[int, list[str]] = {}
        for key, value in self.slots.items():
            by_id.setdefault(id(value), []).append(key)
        self.aliases = {key: by_id[id(value)] for key, value in self.slots.items()}
        cut = len(prefix) if prefix else 0
        self.file_key: dict[str, str] = {}
        self.unexpected: list[str] = []
        # peft on a meta model: "a.base_layer.weight" is filled by the file's "a.weight", and
        # its adapters, which a base checkpoint lacks, are initialized after loading
        # (vramkit.io.adapters).
        renamed = {peft_base_key(k): k for k in self.slots if ".base_layer." in k}
        self.adapters = adapter_keys(module) if renamed else set()
        names = checkpoint.tensor_names()
        in_file = {name[cut:] for name in names if not prefix or name.startswith(prefix)}
        for name in names:
            if prefix and not name.startswith(prefix):
                continue
            key = name[cut:]
            if skipped and key.startswith(skipped):
                continue
            if key in self.slots:
                self.file_key[name] = key
            elif key in renamed and renamed[key] not in in_file:
                self.file_key[name] = renamed[key]
            else:
                self.unexpected.append(key)
        present = set(self.file_key.values())
        self.missing = [key for key in self.slots
                        if not any(alias in present for alias in self.aliases[key])
                        and key not in self.adapters]
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
        # Set by _plan_quantization: the config and vramkit.quant.model's walk functions.
        self._config: Any = None
        self._quantize_weight: Any = None
        self._quantized_layer: Any = None
        if quantization is not None:
            self._plan_quantization(quantization)

    def _plan_quantization(self, config: Any) -> None:
        # Imported on use: vramkit.quant registers its torch custom ops when imported, which
        # plain loads need not pay for.
        from vramkit.quant.model import (
            QuantizationConfig,
            quantizable_layers,
            quantize_weight,
            quantized_layer,
        )

        if not isinstance(config, QuantizationConfig):
            raise ConfigError(f"quantization must be a {QuantizationConfig.__name__}, got "
                              f"{type(config).__name__}",
                              hint="Pass quantization=QuantizationConfig(weights_dtype='int8') "
                                   "(from vramkit.quant.model), or None to load unquantized.")
        if config.min_sqnr_db is not None:
            raise ConfigError(
                "load_into(quantization=...) cannot apply min_sqnr_db: it quantizes each weight "
                "as it streams in, before a quality check could keep it in full precision",
                hint="Load in full precision and call quantize_model(model, config), or drop "
                     "min_sqnr_db.")
        self._config = config
        self._quantize_weight, self._quantized_layer = quantize_weight, quantized_layer
        for name, layer in quantizable_layers(self.module, config):
            weight_key = f"{name}.weight"
            if len(self.aliases.get(weight_key, ())) > 1:
                # One tensor under several keys (a module registered twice): the checkpoint may
                # hold it under any of them, and it is assigned to all, so it stays unquantized.
                logger.info("not quantizing %s: its weight is also named %s", name,
                            self.aliases[weight_key])
                continue
            pending = _QuantPending(name, layer, has_bias=layer.bias is not None)
            self.quant[name] = pending
            self.weight_of[weight_key] = pending
            if layer.bias is not None:
                self.bias_of[f"{name}.bias"] = pending

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
        if not self.file_key:  # nothing matched at all: say what the file holds
            fmt = getattr(self.checkpoint, "format", None)
            held = describe_names(self.checkpoint.tensor_names())
            message += (f". No tensor matched: the file holds {held}"
                        + (f" ({fmt.describe()})" if fmt is not None else "")
                        + "; the layouts known are diffusers', the original FLUX (bare or under "
                        "'model.diffusion_model.') and SDXL's LDM UNet")
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
            # Never None: min_sqnr_db, the only reason to keep a weight, is refused.
            pending.quantized = self._quantize_weight(tensor, self._config, name=key)
            del tensor
            self._finish_quantized(pending)
        elif key in self.bias_of:
            pending = self.bias_of[key]
            pending.bias = tensor
            self._finish_quantized(pending)
        else:
            self.assign(key, tensor)
        self.loaded.append(key)

    def assign(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """Put ``tensor`` in place of the module's tensor ``key`` (under every name it has; a
        ``Parameter`` stays a ``Parameter`` with its ``requires_grad``); returns the object now
        in the module."""
        current = self.slots[key]
        value: torch.Tensor = tensor
        if isinstance(current, nn.Parameter):
            value = nn.Parameter(tensor, requires_grad=current.requires_grad
                                 and (tensor.is_floating_point() or tensor.is_complex()))
        for alias in self.aliases[key]:
            owner_name, _, attr = alias.rpartition(".")
            owner = self.module.get_submodule(owner_name) if owner_name else self.module
            setattr(owner, attr, value)
        return value

    def _finish_quantized(self, pending: _QuantPending) -> None:
        if pending.quantized is None or (pending.has_bias and pending.bias is None):
            return
        layer = self._quantized_layer(pending.layer, pending.quantized, pending.bias,
                                      self._config, name=pending.module_name)
        parent_name, _, child = pending.module_name.rpartition(".")
        parent = self.module.get_submodule(parent_name) if parent_name else self.module
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
        adapters = init_meta_adapters(self.module, self._weights_device())
        if adapters:
            logger.info("initialized %d LoRA adapter tensor(s) the checkpoint does not hold, "
                        "peft's way", len(adapters))
        initialized = recompute_meta_buffers(self.module, self._weights_device())
        if initialized:
            logger.info("recomputed %d non-persistent buffer(s) on %s with the model's own "
                        "initializer: %s", len(initialized), self._weights_device(),
                        ", ".join(initialized))
        still_meta = [name for name, t in (*self.module.named_parameters(),
                                           *self.module.named_buffers()) if t.is_meta]
        if still_meta:
            logger.warning("%s", self._still_meta_message(still_meta))
        return LoadResult(loaded_keys=self.loaded, missing_keys=self.missing,
                          unexpected_keys=self.unexpected,
                          quantized_modules=[p.module_name for p in self.quant.values() if p.done],
                          still_meta=still_meta, stats=stats, initialized_buffers=initialized)

    def _weights_device(self) -> torch.device:
        # Where the loaded tensors went (a bare "cuda" resolved to its ordinal).
        for tensor in (*self.module.parameters(), *self.module.buffers()):
            if not tensor.is_meta:
                return tensor.device
        return self.device

    def _still_meta_message(self, still_meta: list[str]) -> str:
        non_persistent = {f"{owner}.{attr}" if owner else attr
                          for owner, (_, attrs) in meta_non_persistent_buffers(self.module).items()
                          for attr in attrs}
        buffers = [name for name in still_meta if name in non_persistent]
        others = [name for name in still_meta if name not in non_persistent]
        parts = []
        if others:
            parts.append(f"{len(others)} missing from the checkpoint: {_listed(others)}")
        if buffers:
            parts.append(f"{len(buffers)} non-persistent buffer(s), which checkpoints never hold "
                         f"and which the module offers no way to recompute: {_listed(buffers)}")
        return (f"{len(still_meta)} tensor(s) are still on the meta device after loading, and "
                f"the module cannot run until they are set: {'; '.join(parts)}. Assign each on "
                "the target device (for a buffer: owner.register_buffer(name, value, "
                "persistent=False)), or build the modules that own them off the meta device.")


def _listed(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
