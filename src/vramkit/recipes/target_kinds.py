"""Which of ``build_target``'s input options a family of models takes, and the check that
refuses the others before anything is built.

:data:`~vramkit.recipes.targets.TARGET_KINDS` (in :mod:`vramkit.recipes.targets`, beside the
families it describes) declares each family's :class:`TargetKind`;
:func:`~vramkit.recipes.targets.target_options` reads a model's family from its name or config
alone and returns its :class:`TargetOptions`, whose :meth:`~TargetOptions.check` ``vramkit plan``
runs on its flags before any work.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from vramkit.errors import ConfigError

__all__ = ["INPUT_OPTIONS", "TargetKind", "TargetOptions"]


@dataclass(frozen=True)
class TargetKind:
    """What a family of models is, and which of :func:`build_target`'s input options it takes.

    Attributes:
        what: the family in words (``"an image model"``).
        options: the options of :func:`build_target` it takes among :data:`INPUT_OPTIONS`
            (``mode``, ``lora_rank``, ``batch``, ``dtype`` and ``lora_targets`` apply to all).
    """

    what: str
    options: tuple[str, ...]


#: The options whose meaning depends on the model: each family takes some of them.
INPUT_OPTIONS = ("resolution", "frames", "seq_len")


class TargetOptions(NamedTuple):
    """A model's family and the options it takes, known from its name or config alone
    (:func:`target_options`: nothing is built)."""

    name: str
    family: str
    kind: TargetKind

    def check(self, given: Mapping[str, object], flags: Mapping[str, str] | None = None) -> None:
        """Refuse the options of :data:`INPUT_OPTIONS` given (not ``None``) that the model does
        not take.

        Args:
            given: option name -> value (``None``: not given).
            flags: option name -> how the caller spells it (``"--frames"``); default the name.

        Raises:
            ConfigError: naming the first option the model does not take and the ones it does.
        """
        def spelled(option: str) -> str:
            return (flags or {}).get(option, option)

        for option in INPUT_OPTIONS:
            if given.get(option) is not None and option not in self.kind.options:
                takes = ", ".join(spelled(o) for o in self.kind.options)
                raise ConfigError(f"{self.name} is {self.kind.what}: {spelled(option)} does not "
                                  f"apply (it takes {takes})",
                                  hint=f"Leave {spelled(option)} unset for {self.name}.")
