"""Low-memory optimizers.

:mod:`vramkit.optim.adamw8bit` holds :class:`~vramkit.optim.adamw8bit.AdamW8bit` (AdamW with
block-wise quantized 8- or 4-bit moments, about 2 bytes of state per parameter) and
:mod:`vramkit.optim.config` holds :class:`~vramkit.optim.config.Int8TrainingConfig`, which gives
the optimizer and gradient accumulation in a chosen dtype from one config
(:func:`~vramkit.optim.config.setup_int8_training`). The block-wise code books live in the
private :mod:`vramkit.optim._blockwise`.

Their public names are re-exported here lazily: importing the package imports neither module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vramkit._lazy import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    ".adamw8bit": ("AdamW8bit",),
    ".config": ("Int8Training", "Int8TrainingConfig", "setup_int8_training"),
})

if TYPE_CHECKING:  # static analysers see the real definitions
    from vramkit.optim.adamw8bit import *  # noqa: F403
    from vramkit.optim.config import *  # noqa: F403
