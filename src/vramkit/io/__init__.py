"""Loading large safetensors checkpoints: lazy, sharded, streaming, direct to GPU, quantizing.

* :mod:`vramkit.io.lazy` -- :class:`~vramkit.io.lazy.LazySafetensors`: open a file, a Hugging
  Face sharded directory or a ``*.safetensors.index.json`` as one logical checkpoint; names,
  shapes, dtypes and metadata without reading data; tensors and slices read on demand.
* :mod:`vramkit.io.loader` -- :class:`~vramkit.io.loader.MemoryEfficientLoader`:
  ``load_safetensors``, ``load_with_dtype_conversion``, ``stream_weights`` (bounded memory) and
  ``load_into`` (fills a module built on the meta device, optionally quantizing tensor by tensor).
  To a CUDA device, file bytes go through double-buffered pinned staging buffers while the
  previous chunk copies host->device on the shared copy stream.
* The header parser (:mod:`vramkit.io._header`) validates every field itself and reports any
  malformed input as :class:`vramkit.errors.SafetensorsFormatError`.
* :mod:`vramkit.io.disk` -- ``measure_read_bandwidth``: a timed cold read of a checkpoint
  (``O_DIRECT``, else buffered after ``drop_page_cache``), what ``vramkit info --disk`` shows.
* :mod:`vramkit.io.adapters` -- peft LoRA added on the meta device: the renamed base weights
  (``q.base_layer.weight``) load from the base checkpoint's ``q.weight``, the adapters it lacks
  are initialized peft's way after loading.
* :mod:`vramkit.io.adapter_files` -- LoRA adapters (peft's, or a kohya-style network's) saved
  and loaded in the layouts users load: peft, diffusers, kohya, ComfyUI (``save_adapters``,
  ``load_adapters``).
* :mod:`vramkit.io.formats` -- the one door for the files users bring: ``open_checkpoint``
  detects single-file FLUX/SDXL layouts, ``fp8_scaled`` files and GGUF files from their bytes and
  opens them with the diffusers model's names (fused tensors split into row ranges of the file);
  ``prepare_module`` turns layers whose weights stay packed into ``GGUFLinear`` /
  fp8 ``QuantizedLinear`` before loading; ``detect_format`` names a file's format without torch.
* :mod:`vramkit.io.prefetch` -- ``prefetch_checkpoint``: a checkpoint read into the page cache
  on background threads while the process imports and plans (stdlib only; ``vramkit.fit``
  starts it for its ``checkpoint=``).
* Paths are classified before anything is opened (:mod:`vramkit.io._paths`): a named pipe,
  socket or device, a symbolic-link loop, a Hugging Face repo id, a diffusers pipeline root or a
  pickle checkpoint is refused at once with an error saying what it is and what to pass.

The public names of :mod:`~vramkit.io.lazy`, :mod:`~vramkit.io.loader`,
:mod:`~vramkit.io.disk`, :mod:`~vramkit.io.adapters`, :mod:`~vramkit.io.adapter_files`,
:mod:`~vramkit.io.prefetch` and :mod:`~vramkit.io.formats` are re-exported here lazily:
importing the package imports none of them. Nothing here touches CUDA at import time. See ``docs/loading.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramkit._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    ".lazy": ("BadShard", "LazySafetensors", "ReadThreads", "TensorSlice", "resolve_checkpoint"),
    ".loader": ("LoadResult", "LoadStats", "MemoryEfficientLoader", "load_into",
                "stream_weights"),
    ".disk": ("DiskReadResult", "drop_page_cache", "measure_read_bandwidth"),
    ".adapters": ("adapter_keys", "base_layer_of", "init_meta_adapters", "peft_base_key"),
    ".adapter_files": ("LORA_LAYOUTS", "LoRAFactors", "adapter_state_dict", "load_adapters",
                       "lora_factors", "save_adapters"),
    ".prefetch": ("PAGE_CACHE_SHARE", "Prefetch", "checkpoint_files", "prefetch_checkpoint"),
    ".formats": ("CheckpointFormat", "MappedCheckpoint", "describe_names", "detect_format",
                 "gguf_file", "model_prefix", "open_checkpoint", "prepare_module",
                 "write_gguf"),
})

if TYPE_CHECKING:  # static analysers see the real definitions
    from vramkit.io.adapter_files import *  # noqa: F403
    from vramkit.io.adapters import *  # noqa: F403
    from vramkit.io.disk import *  # noqa: F403
    from vramkit.io.formats import *  # noqa: F403
    from vramkit.io.lazy import *  # noqa: F403
    from vramkit.io.loader import *  # noqa: F403
    from vramkit.io.prefetch import *  # noqa: F403
