"""The one place vramkit checks the fields it is given: ints, bools, numbers, sizes, choices,
device names, and the keys of a config rebuilt from a dict.

Every check raises :class:`~vramkit.errors.ConfigError` (also a ``ValueError``) with a message
that names the field and the value, and a hint that says what the field accepts. Each returns
the value in its canonical form (a size string becomes bytes, a device string a
``torch.device``), so a config validates a field once, in ``__post_init__``, and stores the
result; whoever receives the config uses it as is.

A ``bool`` is never accepted as a number: ``True`` is an ``int`` in Python, but
``num_slots=True`` is a mistake, not one slot.

Device names are checked for form only (``"cpu"``, ``"cuda"``, ``"cuda:N"``, an ordinal, a
``torch.device``): whether such a device is present is a question for
:func:`vramkit.devices.resolve.resolve_device`, asked when work starts, so configs can be made
on machines without the device (plans, tests).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import Any, TypeVar

from vramkit.errors import ConfigError, InvalidDeviceError
from vramkit.units import parse_size

__all__ = [
    "check_bool",
    "check_choice",
    "check_device",
    "check_int",
    "check_known_fields",
    "check_number",
    "check_size",
]

_T = TypeVar("_T")


def _range_text(minimum: float | None, maximum: float | None, *, low_open: bool = False,
                high_open: bool = False) -> str:
    if minimum is not None and maximum is not None:
        return (f"in {'(' if low_open else '['}{minimum}, {maximum}"
                f"{')' if high_open else ']'}")
    if minimum is not None:
        return f"{'>' if low_open else '>='} {minimum}"
    if maximum is not None:
        return f"{'<' if high_open else '<='} {maximum}"
    return ""


def check_int(name: str, value: object, *, minimum: int | None = None,
              maximum: int | None = None, allow_none: bool = False,
              hint: str | None = None) -> Any:
    """``value`` as an int within ``[minimum, maximum]`` (``None`` passes when allowed).

    Args:
        name: the field, as the user knows it (``"SwapConfig.num_slots"``).
        value: what was given.
        minimum / maximum: inclusive bounds (``None``: unbounded).
        allow_none: accept ``None`` (returned as is).
        hint: what to try instead (default: the accepted range, in words).

    Raises:
        ConfigError: for a bool, a non-int, or an int out of range.
    """
    if value is None and allow_none:
        return None
    in_range = not (isinstance(value, bool) or not isinstance(value, int)
                    or (minimum is not None and value < minimum)
                    or (maximum is not None and value > maximum))
    if in_range:
        return value
    bounds = _range_text(minimum, maximum)
    wanted = f"an int {bounds}".rstrip() + (" or None" if allow_none else "")
    raise ConfigError(f"{name} must be {wanted}, got {value!r}",
                      hint=hint or f"Give {name} as a whole number {bounds}.".replace("  ", " "))


def check_bool(name: str, value: object, *, allow_none: bool = False,
               hint: str | None = None) -> Any:
    """``value`` if it is ``True`` or ``False`` (or ``None`` when allowed).

    Raises:
        ConfigError: for anything else (``1``, ``"yes"``...).
    """
    if isinstance(value, bool) or (value is None and allow_none):
        return value
    wanted = "True, False or None" if allow_none else "a bool"
    raise ConfigError(f"{name} must be {wanted}, got {value!r}",
                      hint=hint or f"Pass {name}=True or {name}=False.")


def check_number(name: str, value: object, *, minimum: float | None = None,
                 maximum: float | None = None, low_open: bool = False,
                 high_open: bool = False, allow_none: bool = False,
                 hint: str | None = None) -> Any:
    """``value`` as a finite float within the bounds.

    Args:
        name: the field.
        value: an int or float (not a bool).
        minimum / maximum: bounds (``None``: unbounded).
        low_open / high_open: exclude the bound itself (``> 0`` rather than ``>= 0``).
        allow_none: accept ``None`` (returned as is).
        hint: what to try instead.

    Returns:
        ``float(value)``.

    Raises:
        ConfigError: for a bool, a non-number, NaN/inf, or a number out of range.
    """
    if value is None and allow_none:
        return None
    bounds = _range_text(minimum, maximum, low_open=low_open, high_open=high_open)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        number = float(value)  # type: ignore[arg-type]
        ok = (math.isfinite(number)
              and (minimum is None or (number > minimum if low_open else number >= minimum))
              and (maximum is None or (number < maximum if high_open else number <= maximum)))
        if ok:
            return number
    wanted = f"a finite number {bounds}".rstrip() + (" or None" if allow_none else "")
    raise ConfigError(f"{name} must be {wanted}, got {value!r}",
                      hint=hint or f"Give {name} as a number {bounds}.".replace("  ", " "))


def check_size(name: str, value: object, *, minimum: int = 0, allow_none: bool = False,
               hint: str | None = None) -> Any:
    """``value`` (bytes, or a string such as ``"6GiB"``) as an int number of bytes.

    Args:
        name: the field.
        value: an int, or a size string :func:`vramkit.units.parse_size` reads.
        minimum: the smallest size accepted, in bytes (default 0).
        allow_none: accept ``None`` (returned as is).
        hint: what to try instead (default: examples of sizes).

    Raises:
        ConfigError: for values that are not sizes or are below ``minimum``.
    """
    if value is None and allow_none:
        return None
    default_hint = "Give a byte count or a size such as '6GiB', '1500MB' or '2G'."
    try:
        nbytes = parse_size(value)  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{name}: {exc}", hint=hint or default_hint) from None
    if nbytes < minimum:
        raise ConfigError(f"{name} must be at least {minimum} bytes, got {value!r}",
                          hint=hint or default_hint)
    return nbytes


def check_choice(name: str, value: _T, choices: Collection[_T], *,
                 hint: str | None = None) -> _T:
    """``value`` if it is one of ``choices``.

    Raises:
        ConfigError: naming the choices.
    """
    try:
        ok = value in choices and not (isinstance(value, bool) and True not in choices)
    except TypeError:  # unhashable against a set
        ok = False
    if ok:
        return value
    listed = ", ".join(repr(c) for c in choices)
    raise ConfigError(f"{name} must be one of {listed}, got {value!r}",
                      hint=hint or f"Choose {name} from {listed}.")


def check_device(name: str, value: object, *, types: Collection[str] = ("cpu", "cuda"),
                 allow_none: bool = False) -> Any:
    """The ``torch.device`` a device value names, checked for form (not for presence).

    Args:
        name: the field (``"device"``, ``"BlockSwapper device"``).
        value: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, an int CUDA ordinal, a ``torch.device``, or
            an object with a ``torch_device`` attribute (vramkit's ``Device`` handle).
        types: device types accepted (default cpu and cuda).
        allow_none: accept ``None`` (returned as is).

    Returns:
        The ``torch.device`` (``cuda`` may come without an index: the current device).

    Raises:
        InvalidDeviceError: (a ``ConfigError`` and a ``DeviceError``) for a bool, a negative
            ordinal, text torch does not parse, or a device type not in ``types``.
    """
    import torch

    if value is None and allow_none:
        return None
    hint = "Use " + ", ".join(
        {"cpu": "'cpu'", "cuda": "'cuda', 'cuda:N' or an integer CUDA ordinal",
         "meta": "'meta'"}.get(t, repr(t)) for t in types) + "."
    if isinstance(value, bool):
        raise InvalidDeviceError(f"invalid device {value!r} for {name}: a boolean is not a "
                                 "device", hint=hint)
    if isinstance(value, int):
        if value < 0:
            raise InvalidDeviceError(f"invalid CUDA ordinal {value} for {name}: ordinals are "
                                     ">= 0", hint=hint)
        device = torch.device("cuda", value)
    else:
        raw = getattr(value, "torch_device", value)
        try:
            device = raw if isinstance(raw, torch.device) else torch.device(raw)  # type: ignore[arg-type]
        except (RuntimeError, TypeError, ValueError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise InvalidDeviceError(f"invalid device {value!r} for {name}: {reason}",
                                     hint=hint) from None
    if device.type not in types:
        accepted = " or ".join(repr(t) for t in types)
        raise InvalidDeviceError(f"invalid device {value!r} for {name}: it takes {accepted}, "
                                 f"not {device.type!r}", hint=hint)
    return device


def check_known_fields(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` as a new dict, after checking every key names a field of dataclass ``cls``.

    Args:
        cls: a dataclass type.
        data: field name -> value (missing fields take their defaults when ``cls`` is built).

    Returns:
        A copy of ``data`` the caller may convert further before ``cls(**values)``.

    Raises:
        ConfigError: naming the unknown keys and the known ones.
    """
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} keys: {unknown}",
                          hint=f"Known keys: {sorted(known)}.")
    return dict(data)
