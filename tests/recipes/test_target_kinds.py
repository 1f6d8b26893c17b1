"""A family's declared options: the ones it does not take are refused, in the caller's words."""

from __future__ import annotations

import pytest

from vramkit.errors import ConfigError
from vramkit.recipes.target_kinds import TargetKind, TargetOptions

VIDEO = TargetOptions("my-video", "video", TargetKind("a video model", ("resolution", "frames")))
TEXT = TargetOptions("my-lm", "causal-lm", TargetKind("a language model", ("seq_len",)))


def test_options_a_family_declares_pass_and_others_are_refused_by_their_spelling() -> None:
    VIDEO.check({"resolution": "480x832", "frames": 81, "seq_len": None})  # None: not given
    with pytest.raises(ConfigError) as raised:
        VIDEO.check({"seq_len": 77}, {"seq_len": "--seq-len", "frames": "--frames",
                                      "resolution": "--resolution"})
    assert raised.value.message == ("my-video is a video model: --seq-len does not apply (it "
                                    "takes --resolution, --frames)")
    assert raised.value.hint == "Leave --seq-len unset for my-video."
    with pytest.raises(ConfigError, match="language model: resolution does not apply"):
        TEXT.check({"resolution": 512})
