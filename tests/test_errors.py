from __future__ import annotations

import ast
import collections
import pickle
from pathlib import Path

import pytest

import vramkit
from vramkit import errors


def test_every_error_has_a_hint_in_its_message() -> None:
    samples = [
        errors.VramkitError("boom"),
        errors.ConfigError("bad value"),
        errors.DeviceError("no such device"),
        errors.DeviceMismatchError("cuda:0", "cpu", what="input"),
        errors.NvmlError("no NVML"),
        errors.JaxUnavailableError("no jax"),
        errors.TooLateError("PYTORCH_ALLOC_CONF", "CUDA is already initialized"),
        errors.PoolExhaustedError("full", requested=10),
        errors.InvalidBlockError("double free"),
    ]
    for err in samples:
        assert err.hint, type(err)
        assert "hint:" in str(err)
        assert isinstance(err, errors.VramkitError)


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        raise errors.ConfigError("fraction must be in (0, 1]")


def test_device_mismatch_keeps_expected_and_got() -> None:
    err = errors.DeviceMismatchError("cuda:0", "cpu", what="argument 1")
    assert err.expected == "cuda:0"
    assert err.got == "cpu"
    assert "argument 1 is on cpu" in str(err)
    assert "expected cuda:0" in str(err)


def test_too_late_names_the_setting() -> None:
    err = errors.TooLateError("XLA_CLIENT_MEM_FRACTION", "the JAX backend already started")
    assert err.setting == "XLA_CLIENT_MEM_FRACTION"
    assert "XLA_CLIENT_MEM_FRACTION" in str(err)


def test_pool_exhausted_is_a_memory_error() -> None:
    err = errors.PoolExhaustedError("over cap", requested=4096, stats={"reserved": 1})
    assert isinstance(err, MemoryError)
    assert err.requested == 4096


def test_custom_hint_and_pickling() -> None:
    err = errors.DeviceMismatchError("cuda:1", "cuda:0", hint="use .to('cuda:1')")
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is errors.DeviceMismatchError
    assert clone.expected == "cuda:1"
    assert str(clone) == str(err)


# -- every raise of a generic error class carries a hint that fits it -----------------------------

# Classes whose default hint is generic: a raise must give its own. The other classes
# (DeviceError, SafetensorsFormatError, PoolExhaustedError, ...) have defaults that fit
# every raise, so they may rely on them.
_GENERIC_ERRORS = frozenset(
    {"ConfigError", "OffloadError", "QuantizationError", "KernelError", "VramkitError"})
# A literal hint may be repeated by a few raises of the same situation; more means a
# catch-all sentence was pasted around. A shared constant (a name, not a literal) is exempt.
_MAX_SAME_HINT = 5


def _vramkit_sources() -> list[tuple[str, ast.Module]]:
    root = Path(vramkit.__file__).resolve().parent
    return [(f"{path.relative_to(root.parent)}", ast.parse(path.read_text(encoding="utf-8")))
            for path in sorted(root.rglob("*.py"))]


def _generic_names(tree: ast.Module) -> set[str]:
    """Names the module binds to the generic classes (their own names, and import aliases)."""
    names = set(_GENERIC_ERRORS)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("vramkit.errors", "errors"):
            names.update(alias.asname for alias in node.names
                         if alias.asname and alias.name in _GENERIC_ERRORS)
    return names


def _called_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id  # ConfigError(...)
    if isinstance(func, ast.Attribute):
        return func.attr  # errors.ConfigError(...), vramkit.errors.ConfigError(...)
    return None


def _hint_argument(call: ast.Call) -> ast.expr | None:
    for keyword in call.keywords:
        if keyword.arg == "hint":
            return keyword.value
    if len(call.args) > 1:
        return call.args[1]  # VramkitError(message, hint)
    return None


def _passes_unknown_arguments(call: ast.Call) -> bool:
    """``*args`` / ``**kwargs``: the hint may be in them; not judged."""
    return (any(isinstance(arg, ast.Starred) for arg in call.args)
            or any(keyword.arg is None for keyword in call.keywords))


def _hintless_raises(path: str, tree: ast.Module) -> list[str]:
    """``path:line`` of each generic error built without a hint, and each ``raise Class``."""
    generic = _generic_names(tree)
    found = []
    for node in ast.walk(tree):
        # Every construction, raised here or built to be raised elsewhere.
        if (isinstance(node, ast.Call) and _called_name(node.func) in generic
                and _hint_argument(node) is None and not _passes_unknown_arguments(node)):
            found.append(f"{path}:{node.lineno}: {_called_name(node.func)}(...) has no hint")
        # `raise ConfigError` (the class itself): always the default hint.
        if (isinstance(node, ast.Raise) and node.exc is not None
                and not isinstance(node.exc, ast.Call) and _called_name(node.exc) in generic):
            found.append(f"{path}:{node.lineno}: raise {_called_name(node.exc)} has no message "
                         "or hint")
    return sorted(found, key=lambda line: int(line.split(":")[1]))


def test_the_hint_check_sees_every_form() -> None:
    source = """
from vramkit.errors import ConfigError as CE
from vramkit import errors
raise ConfigError("a")
raise errors.OffloadError(f"b {x}") from err
raise CE("c")
raise QuantizationError
err = KernelError("d", log="...")
raise ConfigError("ok", hint="Use num_slots=2.")
raise KernelError("ok", "Install the extra.")
raise DeviceError("specific default")
raise ConfigError(*args)
"""
    found = _hintless_raises("x.py", ast.parse(source))
    assert [line.split(":")[1] for line in found] == ["4", "5", "6", "7", "8"], found


def test_generic_errors_are_raised_with_their_own_hint() -> None:
    missing = [line for path, tree in _vramkit_sources() for line in _hintless_raises(path, tree)]
    assert not missing, ("raises of a generic error class must pass hint= (what the user can "
                         "do about THIS error):\n" + "\n".join(missing))


def test_literal_hints_are_not_pasted_everywhere() -> None:
    uses: dict[str, list[str]] = collections.defaultdict(list)
    for path, tree in _vramkit_sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                hint = _hint_argument(node.exc)
                if isinstance(hint, (ast.Constant, ast.JoinedStr)):
                    uses[ast.unparse(hint)].append(f"{path}:{node.lineno}")
    assert uses, "found no hints: did the source walk break?"
    repeated = {hint: places for hint, places in uses.items() if len(places) > _MAX_SAME_HINT}
    assert not repeated, "\n".join(f"{len(places)} raises share the hint {hint}: {places}"
                                   for hint, places in repeated.items())


def test_raised_hints_fit_the_error() -> None:
    from vramkit.memory.layout import align_up
    from vramkit.offload.blocks import find_blocks
    from vramkit.tiling.vae import plan_tiles

    cases = [(lambda: align_up(0, 3), "power-of-two"),
             (lambda: plan_tiles(0, 64, 8), "overlap < tile"),
             (lambda: find_blocks(object()), "nn.Module")]  # type: ignore[arg-type]
    for make, wanted in cases:
        with pytest.raises(errors.VramkitError) as info:
            make()
        assert info.value.hint != type(info.value).default_hint
        assert wanted in info.value.hint, info.value
