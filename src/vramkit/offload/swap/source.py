"""Where a swapper's weights come from when it attaches to a model built on the meta device:
a safetensors checkpoint, read straight into the swapped layout.

``BlockSwapper(model_on_meta, config, checkpoint=path)`` never builds the model on the CPU:

* each swapped tensor is read from the file into its place in the block's pinned master (one
  ``pread`` per byte, split across read threads; no intermediate pageable copy). A tensor stored
  in another dtype than the module's is read into a temporary and converted, one tensor at a
  time;
* every other tensor (resident blocks, the rest of the model, swapped blocks' small tensors)
  goes to the device through the loader's double-buffered pinned staging
  (:meth:`vramkit.io.loader.MemoryEfficientLoader.stream_entries`);
* non-persistent buffers left on meta are recomputed where the model offers a way
  (:func:`vramkit.io._buffers.recompute_meta_buffers`).

Keys are matched as :func:`vramkit.io.loader.load_into` matches them (``prefix``, tied tensors,
shape checks, ``strict``), before any memory is allocated.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from vramkit.errors import ConfigError
from vramkit.io._buffers import recompute_meta_buffers
from vramkit.io._header import TensorEntry
from vramkit.io.adapters import init_meta_adapters
from vramkit.io.formats import open_checkpoint, prepare_module
from vramkit.io.lazy import ReadThreads
from vramkit.io.loader import MemoryEfficientLoader, ModuleFiller, progress_bar, show_progress

__all__ = ["CheckpointSource"]

logger = logging.getLogger(__name__)

_PIECE = 16 << 20  # reads of a tensor are split into pieces of this size across the threads
_MAX_BUFFERS = 512  # buffers of one preadv (IOV_MAX is 1024 on Linux)

class CheckpointSource:
    """An open checkpoint matched against a model's tensors.

    Args:
        model: the model (typically built under ``torch.device("meta")``).
        path: a safetensors file, a sharded directory, a ``*.safetensors.index.json`` or a
            diffusers component folder.
        prefix: checkpoint names start with this prefix, removed to form module keys.
        strict: refuse missing or unexpected keys (default ``True``).
        progress: show a progress bar (``None``: for at least 1 GiB on a terminal).
        skip: qualified names of submodules filled another way (quantized while loading by
            ``vramkit.fit``): their keys are neither read nor required.

    Raises:
        ConfigError: for keys that do not match (``strict``) or shapes that differ.
        SafetensorsFormatError: for a malformed checkpoint.
    """

    def __init__(self, model: nn.Module, path: str | os.PathLike[str], *,
                 prefix: str | None = None, strict: bool = True,
                 progress: bool | None = None, skip: Sequence[str] = ()) -> None:
        # Positional reads: bytes go from the file straight into the pinned masters. The io
        # door opens single-file, fp8_scaled and GGUF files with the model's names, and
        # prepare_module makes GGUF layers packed on meta before the swapper lays out blocks.
        self.checkpoint = open_checkpoint(path, use_mmap=False)
        try:
            prepare_module(model, self.checkpoint)
            self._filler = ModuleFiller(model, self.checkpoint, prefix=prefix, dtype=None,
                                        quantization=None, device=torch.device("cpu"),
                                        skip=skip)
            self._filler.check(strict)
        except BaseException:
            self.checkpoint.close()
            raise
        self.model = model
        self.progress = progress
        self._entry_of: dict[int, TensorEntry] = {}
        for name, key in self._filler.file_key.items():
            self._entry_of.setdefault(id(self._filler.slots[key]), self.checkpoint.entry(name))
        self._threads = ReadThreads(max(1, min(8, os.cpu_count() or 1)))
        self._lock = threading.Lock()
        self.bytes_read = 0

    @property
    def source(self) -> str:
        return str(self.checkpoint.source)

    @property
    def missing_keys(self) -> list[str]:
        return list(self._filler.missing)

    @property
    def unexpected_keys(self) -> list[str]:
        return list(self._filler.unexpected)

    def entry(self, tensor: torch.Tensor) -> TensorEntry | None:
        """The checkpoint tensor that fills ``tensor`` (``None`` when the file lacks it)."""
        return self._entry_of.get(id(tensor))

    def read(self, entry: TensorEntry, dst: torch.Tensor) -> None:
        """Fill ``dst`` (a contiguous CPU view of ``entry``'s shape, in the module's dtype)
        from the file, split across the read threads."""
        self._threads.run(self.scatter_jobs([(entry, dst)], _PIECE))

    def scatter_jobs(self, targets: Sequence[tuple[TensorEntry, torch.Tensor]], piece: int
                     ) -> list[Callable[[], None]]:
        """Jobs (run on any thread, in any order) that fill every ``(entry, dst)`` of
        ``targets`` (``dst``: a contiguous CPU view of the entry's shape in the module's dtype)
        from the file. Tensors that follow each other in a file are read by requests of up to
        ``piece`` bytes, each one ``preadv`` scattered into their destinations, so a block of
        many tensors is a few large sequential reads whatever its layout in memory; a tensor
        stored in another dtype is one job reading a tensor-sized temporary and converting it
        into place."""
        jobs: list[Callable[[], None]] = []
        direct: list[tuple[TensorEntry, torch.Tensor]] = []
        fixed = getattr(self.checkpoint, "fixed_names", frozenset())  # read via load_tensor
        for entry, dst in targets:
            if entry.dtype != dst.dtype or entry.name in fixed:
                jobs.append(functools.partial(self._convert, entry, dst))
            elif entry.nbytes:
                direct.append((entry, dst))
        direct.sort(key=lambda t: (str(t[0].path), t[0].file_offset))
        run: list[torch.Tensor] = []
        run_path: Any = None
        run_start = run_end = run_bytes = 0

        def flush() -> None:
            if run:
                reader = self.checkpoint.reader(run_path)
                jobs.append(functools.partial(self._read_run, reader, list(run), run_start))
                run.clear()

        for entry, dst in direct:
            raw = dst.reshape(-1).view(torch.uint8)
            offset = entry.file_offset
            if entry.path != run_path or offset != run_end:
                flush()
                run_path, run_start, run_end, run_bytes = entry.path, offset, offset, 0
            done = 0
            while done < entry.nbytes:
                if run_bytes >= piece or len(run) >= _MAX_BUFFERS:
                    flush()
                    run_start, run_bytes = run_end, 0
                take = min(entry.nbytes - done, piece - run_bytes)
                run.append(raw[done:done + take])
                done += take
                run_bytes += take
                run_end += take
        flush()
        return jobs

    def _read_run(self, reader: Any, dsts: list[torch.Tensor], offset: int) -> None:
        reader.read_scatter(dsts, offset)
        with self._lock:
            self.bytes_read += sum(d.numel() for d in dsts)

    def _convert(self, entry: TensorEntry, dst: torch.Tensor) -> None:
        dst.copy_(self.checkpoint.load_tensor(entry.name).reshape(dst.shape))
        with self._lock:
            self.bytes_read += entry.nbytes

    def progress_bar(self, total: int) -> Any:
        """A progress bar over ``total`` bytes (a context manager yielding ``advance(n)``)."""
        return progress_bar(show_progress(self.progress, total), total,
                            f"loading {self.checkpoint.source.name}")

    def load_to_device(self, tensors: Sequence[torch.Tensor], device: torch.device
                       ) -> list[tuple[torch.Tensor, bool]]:
        """Load ``tensors`` (the model's own objects) from the file to ``device`` through
        pinned staging. A tensor that is not on meta keeps its object (``.data`` is set); a meta
        one is replaced in the module, under every name it has, by a new object of the same
        kind (meta and real tensors cannot share one).

        Returns:
            ``(object now in the module, whether it replaced a meta tensor)`` per loaded tensor.
        """
        by_name: dict[str, torch.Tensor] = {}
        for t in tensors:
            entry = self._entry_of.get(id(t))
            if entry is not None:
                by_name.setdefault(entry.name, t)
        if not by_name:
            return []
        entries = self.checkpoint.entries(list(by_name))
        placed: list[tuple[torch.Tensor, bool]] = []

        def deliver(name: str, value: torch.Tensor) -> None:
            target = by_name[name]
            if target.is_meta:
                placed.append((self._filler.assign(self._filler.file_key[name], value), True))
            else:
                target.data = value
                placed.append((target, False))

        loader = MemoryEfficientLoader(device, use_mmap=False, progress=self.progress)
        stats = loader.stream_entries(self.checkpoint, entries, deliver,
                                      self._filler.dtype_for)
        with self._lock:
            self.bytes_read += stats.file_bytes
        return placed

    def finish(self, device: torch.device) -> list[torch.Tensor]:
        """Initialize peft adapters the file lacks and recompute non-persistent buffers left on
        meta; refuse a model that still has meta tensors (it could not run). Returns the
        adapter tensors created (on ``device``)."""
        adapters = init_meta_adapters(self.model, device)
        if adapters:
            logger.info("initialized %d LoRA adapter tensor(s) on %s, peft's way",
                        len(adapters), device)
        recomputed = recompute_meta_buffers(self.model, device)
        if recomputed:
            logger.info("recomputed %d non-persistent buffer(s) on %s: %s", len(recomputed),
                        device, ", ".join(recomputed))
        still = [name for name, t in (*self.model.named_parameters(),
                                      *self.model.named_buffers()) if t.is_meta]
        if still:
            raise ConfigError(
                f"{len(still)} tensor(s) of the model are still on the meta device after "
                f"loading {self.checkpoint.source.name}: {', '.join(still[:8])}"
                + (" ..." if len(still) > 8 else ""),
                hint="The checkpoint lacks them (load with strict=True to see which keys are "
                     "missing), or they are non-persistent buffers the model cannot recompute: "
                     "build those modules off the meta device.")
        return adapters

    def close(self) -> None:
        self._threads.close()
        self.checkpoint.close()
