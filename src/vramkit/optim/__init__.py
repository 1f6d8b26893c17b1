"""Low-memory optimizers.

:mod:`vramkit.optim.adamw8bit` holds :class:`~vramkit.optim.adamw8bit.AdamW8bit` (AdamW with
block-wise quantized 8- or 4-bit moments, about 2 bytes of state per parameter) and
:mod:`vramkit.optim.config` holds :class:`~vramkit.optim.config.Int8TrainingConfig`, which gives
the optimizer and gradient accumulation in a chosen dtype from one config
(:func:`~vramkit.optim.config.setup_int8_training`). The block-wise code books live in the
private :mod:`vramkit.optim._blockwise`.
"""
