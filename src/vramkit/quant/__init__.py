"""Quantized weight storage and compute: int8, int4, nf4 and fp8.

``vramkit.quant.formats`` holds the formats (frozen configs, :class:`QuantizedTensor`,
``quantize_tensor``/``dequantize_tensor`` in plain torch); ``vramkit.quant.kernels`` the GPU paths
(Triton dequantize and fused dequantize-matmul, the fp8 GEMM) with the torch fallback used on CPU.
``vramkit.quant.linear`` the quantized layers, ``vramkit.quant.dense`` the batched dequantize of
a block's layers, ``vramkit.quant.model`` the config and the one
layer-replacement walk (``quantize_model``), ``vramkit.quant.report`` per-layer quality and
``vramkit.quant.serialization`` safetensors files with the layout in their metadata;
``vramkit.quant.w8a8`` W8A8 compute for frozen weights (both matmuls in 8 bits);
``vramkit.quant.gguf`` GGUF (llama.cpp) quantized weights kept packed (``GGUFLinear``).
``docs/quantization.md`` describes every layout byte for byte.

Every public name of those modules is re-exported here lazily: importing the package imports none
of them (and registers no torch custom op).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramkit._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    ".dense": ("DenseGroup", "DenseScratch", "dense_nbytes", "group_dense", "ungroup_dense"),
    ".formats": ("FP8Config", "Int4Config", "Int8Config", "NF4Config", "QuantConfigT",
                 "QuantFormat", "QuantizedTensor", "dequantize_tensor", "expected_layout",
                 "format_config", "quantize_tensor", "apply_device_only"),
    ".gguf": ("GGUF_QUANT_TYPES", "GGUFLinear", "GGUFQuantType", "GGUFWeight", "dequantize_gguf",
              "gguf_quant_type"),
    ".kernels": ("FP8_GEMM_MULTIPLE", "FUSED_MAX_TOKENS", "dequantize", "fp8_gemm_fits",
                 "has_fp8_gemm", "quantized_matmul", "triton_available"),
    ".linear": ("QuantizedConv2d", "QuantizedLinear", "register_peft_lora"),
    ".model": ("QuantizationConfig", "QuantoConfig", "is_trainable_for_w8a8", "model_bytes",
               "quantizable_layers", "quantize_model", "quantize_weight", "quantized_layer",
               "sqnr_db"),
    ".report": ("LayerQuality", "QuantizationReport", "quantization_report"),
    ".serialization": ("FORMAT_VERSION", "load_quantized", "load_quantized_model",
                       "quantized_state_dict", "save_quantized"),
    ".w8a8": ("W8A8_CAPABILITY", "W8A8Kind", "W8A8Linear", "check_w8a8_device", "quantize_rows",
              "w8a8_fits", "w8a8_weight_format"),
})

if TYPE_CHECKING:  # static analysers see the real definitions
    from vramkit.quant.dense import *  # noqa: F403
    from vramkit.quant.formats import *  # noqa: F403
    from vramkit.quant.gguf import *  # noqa: F403
    from vramkit.quant.kernels import *  # noqa: F403
    from vramkit.quant.linear import *  # noqa: F403
    from vramkit.quant.model import *  # noqa: F403
    from vramkit.quant.report import *  # noqa: F403
    from vramkit.quant.serialization import *  # noqa: F403
    from vramkit.quant.w8a8 import *  # noqa: F403
