"""Quantized weight storage and compute: int8, int4, nf4 and fp8.

``vramkit.quant.formats`` holds the formats (frozen configs, :class:`QuantizedTensor`,
``quantize_tensor``/``dequantize_tensor`` in plain torch); ``vramkit.quant.kernels`` the GPU paths
(Triton dequantize and fused dequantize-matmul, the fp8 GEMM) with the torch fallback used on CPU.
``docs/quantization.md`` describes every layout byte for byte.
"""
