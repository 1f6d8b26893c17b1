"""The settings and statistics of activation offload (:mod:`vramkit.offload.activations`)."""

from __future__ import annotations

from dataclasses import dataclass

from vramkit._validate import check_int, check_size

__all__ = ["ActivationOffloadConfig", "ActivationOffloadStats", "Counters"]


@dataclass(frozen=True)
class ActivationOffloadConfig:
    """Settings of an :class:`ActivationOffloader`.

    Args:
        min_bytes: tensors whose copy would be smaller than this stay on the device (a copy has
            a fixed cost of a few microseconds; small tensors free little memory). An int or a
            size string. Default ``"1MiB"``.
        prefetch: how many offloaded tensors backward keeps on their way back ahead of the
            one it asks for (in reverse pack order). Default ``2``.
        prefetch_bytes: how many bytes backward keeps on their way back ahead of use: it loads
            further tensors until both ``prefetch`` tensors and ``prefetch_bytes`` bytes are
            ahead. Counting bytes keeps the host->device link busy whatever the tensor sizes
            (two small tensors are gone before the next copy starts). ``prefetch=0`` with
            ``prefetch_bytes=0`` loads each tensor only when backward needs it. An int or a
            size string; default ``"256MiB"`` (about 5 ms of PCIe Gen5 traffic).
        max_pinned_bytes: cap on the pinned pool (bytes or a size string). Tensors that would
            take the pool past it stay on the device (counted in
            :attr:`ActivationOffloadStats.kept_over_cap`). ``None`` (default): no cap.
        max_inflight_bytes: how many bytes of offloaded tensors may keep their device memory
            while their device->host copy runs. Beyond it the compute stream waits (on the GPU,
            not the host) for the oldest copies so their memory can be reused: when the forward
            pass outruns the copy link this trades forward time for memory. ``0`` waits for
            every copy right after issuing it. The tensors still held when backward starts are
            used from the device without a round trip. Default ``"256MiB"``.

    Raises:
        ConfigError: for a negative size or prefetch, or a value of the wrong type.
    """

    min_bytes: int | str = "1MiB"
    prefetch: int = 2
    prefetch_bytes: int | str = "256MiB"
    max_pinned_bytes: int | str | None = None
    max_inflight_bytes: int | str = "256MiB"

    def __post_init__(self) -> None:
        for name in ("min_bytes", "max_inflight_bytes", "prefetch_bytes"):
            object.__setattr__(self, name, check_size(f"ActivationOffloadConfig.{name}",
                                                      getattr(self, name)))
        check_int("ActivationOffloadConfig.prefetch", self.prefetch, minimum=0,
                  hint="2 keeps two tensors in flight ahead of backward; 0 disables "
                       "prefetching.")
        object.__setattr__(self, "max_pinned_bytes", check_size(
            "ActivationOffloadConfig.max_pinned_bytes", self.max_pinned_bytes, minimum=1,
            allow_none=True, hint="Give a size such as '8GiB', or None for no cap."))


@dataclass(frozen=True)
class ActivationOffloadStats:
    """What an :class:`ActivationOffloader` did since creation or :meth:`reset_stats`.

    Attributes:
        offloaded_tensors: saved tensors copied to the host.
        offloaded_bytes: bytes copied device->host.
        deduplicated: saves that reused an already offloaded copy (the same tensor saved twice).
        kept_tensors: saved tensors left on the device, for any reason below.
        kept_bytes: their bytes.
        kept_small: kept because smaller than ``min_bytes``.
        kept_parameters: kept because they are parameters or views of parameters.
        kept_unsupported: kept because on another device, a tensor subclass, not strided, or a
            conjugate/negative view.
        kept_over_cap: kept because the pinned pool was at ``max_pinned_bytes``.
        released: offloaded tensors whose device memory was let go after the compute stream
            waited for their copy (the rest were used by backward straight from the device).
        prefetch_hits: first unpacks that found their tensor already on its way back.
        on_demand_loads: first unpacks that had to start the copy themselves.
        device_hits: first unpacks of tensors whose device memory was still held (the last
            ``max_inflight_bytes`` of a forward pass): no host->device copy.
        loaded_bytes: bytes copied host->device.
        pinned_bytes: pinned (or host-pool) bytes held by offloaded tensors now.
        pinned_peak_bytes: the highest ``pinned_bytes``.
        pool_allocations: host blocks taken from the pool (a steady training loop takes none
            after its first step: see ``reused_blocks``).
        reused_blocks: offloads that reused a host block a previous step freed, without a pool
            call (the device->host copy waits on the GPU for the block's last host->device copy).
        spare_bytes: host blocks kept now for reuse by the next forward pass.
    """

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    deduplicated: int = 0
    kept_tensors: int = 0
    kept_bytes: int = 0
    kept_small: int = 0
    kept_parameters: int = 0
    kept_unsupported: int = 0
    kept_over_cap: int = 0
    released: int = 0
    prefetch_hits: int = 0
    on_demand_loads: int = 0
    device_hits: int = 0
    loaded_bytes: int = 0
    pinned_bytes: int = 0
    pinned_peak_bytes: int = 0
    pool_allocations: int = 0
    reused_blocks: int = 0
    spare_bytes: int = 0

    @property
    def prefetch_hit_rate(self) -> float:
        """``prefetch_hits / (prefetch_hits + on_demand_loads)`` (0.0 before any load)."""
        loads = self.prefetch_hits + self.on_demand_loads
        return self.prefetch_hits / loads if loads else 0.0


class Counters:
    """Mutable counterparts of :class:`ActivationOffloadStats` (updated under the offloader lock)."""

    __slots__ = ("deduplicated", "device_hits", "kept_bytes", "kept_over_cap", "kept_parameters",
                 "kept_small", "kept_unsupported", "loaded_bytes", "offloaded_bytes",
                 "offloaded_tensors", "on_demand_loads", "pinned_bytes", "pinned_peak_bytes",
                 "pool_allocations", "prefetch_hits", "released", "reused_blocks")

    def __init__(self, pinned_bytes: int = 0) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)
        self.pinned_bytes = self.pinned_peak_bytes = pinned_bytes

    def snapshot(self, spare_bytes: int) -> ActivationOffloadStats:
        kept = self.kept_small + self.kept_parameters + self.kept_unsupported + self.kept_over_cap
        return ActivationOffloadStats(
            offloaded_tensors=self.offloaded_tensors, offloaded_bytes=self.offloaded_bytes,
            deduplicated=self.deduplicated, kept_tensors=kept, kept_bytes=self.kept_bytes,
            kept_small=self.kept_small, kept_parameters=self.kept_parameters,
            kept_unsupported=self.kept_unsupported, kept_over_cap=self.kept_over_cap,
            released=self.released, prefetch_hits=self.prefetch_hits,
            on_demand_loads=self.on_demand_loads, device_hits=self.device_hits,
            loaded_bytes=self.loaded_bytes, pinned_bytes=self.pinned_bytes,
            pinned_peak_bytes=self.pinned_peak_bytes, pool_allocations=self.pool_allocations,
            reused_blocks=self.reused_blocks, spare_bytes=spare_bytes)
