"""AdamW with block-wise quantized moments: about 2 bytes of state per parameter instead of 8.

:class:`AdamW8bit` is a ``torch.optim.Optimizer`` that computes the AdamW update (decoupled
weight decay, bias-corrected moments, the same operation order as ``torch.optim.AdamW``) in fp32,
but stores the moments of every tensor with at least ``min_8bit_size`` elements block-wise
quantized (see :mod:`vramkit.optim._blockwise`):

* ``exp_avg`` (m) as signed dynamic-decade codes with one fp32 absmax per block;
* ``sqrt(exp_avg_sq)`` (r = sqrt(v)) as unsigned codes without a zero level, one absmax per block.

With ``state_bits=8`` and ``block_size=256`` that is ``2 + 8 / 256 = 2.03`` bytes per parameter
(``state_bits=4``: ``1.03``), versus 8 for fp32 Adam states. Smaller tensors (biases, norm
scales) keep fp32 ``exp_avg`` / ``exp_avg_sq``; :meth:`AdamW8bit.state_bytes` counts everything.

Each step dequantizes a tensor's states a chunk of blocks at a time (so temporaries stay small
for huge tensors), updates moments and parameter in fp32, and re-quantizes with fresh per-block
absmax values. Parameters may be fp32, bf16 or fp16 (16-bit ones are updated in fp32 and rounded
back), on the CPU or on CUDA; the step never synchronizes the host (the step counter lives on the
CPU). On CUDA with ``triton`` installed, the quantized update of a tensor is one fused kernel
launch (:mod:`vramkit.optim._triton_adamw`, imported on the first CUDA step) that reproduces the
rounding of the torch path; the torch path (vectorised ops) is the reference and the fallback
(CPU, CUDA without triton, other dtypes, blocks over 4096 elements).

Works as the inner optimizer of :class:`vramkit.offload.optimizer.CPUOffloadOptimizer`
(``optimizer_class=AdamW8bit``), which then keeps 2 instead of 8 bytes of state per parameter in
host memory. Compared against bitsandbytes' and torchao's ``AdamW8bit`` in
``benchmarks/adamw8bit.py`` (neither is a dependency).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from vramkit._validate import check_bool, check_choice, check_int, check_number
from vramkit.errors import ConfigError
from vramkit.optim._blockwise import (
    SIGNED,
    UNSIGNED_NONZERO,
    codebook,
    dequantize_blockwise,
    padded_numel,
    quantize_blockwise,
)

__all__ = ["AdamW8bit"]

logger = logging.getLogger(__name__)

# Elements dequantized at once: bounds the fp32 temporaries of one step (m, r, gradient, update:
# ~64 MiB at this size) whatever the tensor's size, and is large enough to keep kernels efficient.
_CHUNK_ELEMENTS = 1 << 22
_QUANTIZED_KEYS = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_sqrt_codes",
                   "exp_avg_sq_sqrt_absmax")
_FULL_KEYS = ("exp_avg", "exp_avg_sq")
_STATE_BITS = (8, 4)
# Dtypes and block sizes the fused kernel takes (mirrors _triton_adamw, which is not imported here
# so that CPU-only use never imports triton).
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FUSED_MAX_BLOCK_SIZE = 4096
# Tests set this to False to force the torch reference path on CUDA.
_FUSED_KERNEL_ENABLED = True
_TRITON_INSTALLED: list[bool] = []  # filled on first use


def _triton_installed() -> bool:
    if not _TRITON_INSTALLED:
        _TRITON_INSTALLED.append(importlib.util.find_spec("triton") is not None)
    return _TRITON_INSTALLED[0]


def _use_fused_kernel(flat_param: torch.Tensor, flat_grad: torch.Tensor,
                      block_size: int) -> bool:
    """Whether the fused Triton step applies: CUDA tensors on one device, triton installed,
    fp32/bf16/fp16 parameter and gradient, a block small enough for one program."""
    return (_FUSED_KERNEL_ENABLED and flat_param.is_cuda
            and flat_grad.device == flat_param.device
            and flat_param.dtype in _FUSED_DTYPES and flat_grad.dtype in _FUSED_DTYPES
            and block_size <= _FUSED_MAX_BLOCK_SIZE and _triton_installed())


def _check_state_settings(block_size: object, min_8bit_size: object, state_bits: object, *,
                          prefix: str = "") -> None:
    """Check the settings of the quantized state (also ``Int8TrainingConfig``'s, whose
    ``prefix`` is ``"Int8TrainingConfig."``).

    Raises:
        ConfigError: for a ``block_size`` that is not an even int >= 2, a negative
            ``min_8bit_size`` or a ``state_bits`` other than 8 or 4.
    """
    check_int(f"{prefix}block_size", block_size, minimum=2)
    if block_size % 2:  # type: ignore[operator]
        raise ConfigError(f"{prefix}block_size must be even (4-bit codes pack in pairs), got "
                          f"{block_size}", hint="Use a power of two such as 256.")
    check_int(f"{prefix}min_8bit_size", min_8bit_size, minimum=0)
    check_choice(f"{prefix}state_bits", state_bits, _STATE_BITS)


def _validate_hyper(group: dict[str, Any]) -> None:
    check_number("lr", group["lr"], minimum=0.0,
                 hint="Pass a Python float >= 0 (tensor learning rates are not supported).")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ConfigError(f"betas must be a pair of numbers, got {betas!r}",
                          hint="Give betas as two numbers in [0, 1), e.g. betas=(0.9, 0.999).")
    for i, beta in enumerate(betas):
        check_number(f"betas[{i}]", beta, minimum=0.0, maximum=1.0, high_open=True)
    check_number("eps", group["eps"], minimum=0.0)
    check_number("weight_decay", group["weight_decay"], minimum=0.0)
    _check_state_settings(group["block_size"], group["min_8bit_size"], group["state_bits"])
    check_bool("master_weights", group.get("master_weights", False))


class AdamW8bit(torch.optim.Optimizer):
    """AdamW whose moments are stored block-wise quantized (8 or 4 bits per value).

    Args:
        params: parameters or parameter groups (floating-point tensors; CPU or CUDA).
        lr: learning rate (default ``1e-3``).
        betas: moment decay rates (default ``(0.9, 0.999)``).
        eps: added to the denominator (default ``1e-8``).
        weight_decay: decoupled weight decay (default ``1e-2``, as ``torch.optim.AdamW``).
        block_size: elements per quantization block, each with its own fp32 absmax (default
            256; smaller blocks track local scale better and cost ``8 / block_size`` bytes per
            parameter of scales). Must be even.
        min_8bit_size: tensors with fewer elements keep fp32 states (default 4096; 0 quantizes
            everything).
        state_bits: 8 (default) or 4 bits per stored moment value.
        master_weights: keep an fp32 copy of every 16-bit parameter in the state (4 bytes per
            parameter) and update it, rounding the result into the parameter: bf16/fp16
            training without losing updates smaller than the parameter's precision. It is
            state like the moments, so with ``SwapConfig(trainable="swap")`` it travels with its
            block. Default ``False`` (16-bit parameters are updated in fp32 and rounded back,
            as ``torch.optim.AdamW`` does).

    Raises:
        ConfigError: for an invalid hyperparameter or parameter.

    Example:
        >>> model = torch.nn.Linear(128, 64)
        >>> opt = AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=0)
        >>> model(torch.randn(4, 128)).square().mean().backward()
        >>> opt.step(); opt.zero_grad()
        >>> round(opt.state_bytes() / sum(p.numel() for p in model.parameters()), 2) <= 2.1
        True
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, block_size: int = 256,
                 min_8bit_size: int = 4096, state_bits: int = 8,
                 master_weights: bool = False) -> None:
        defaults = {"lr": lr, "betas": tuple(betas) if isinstance(betas, list) else betas,
                    "eps": eps, "weight_decay": weight_decay, "block_size": block_size,
                    "min_8bit_size": min_8bit_size, "state_bits": state_bits,
                    "master_weights": master_weights}
        _validate_hyper(defaults)
        if isinstance(params, torch.Tensor):
            raise ConfigError("params must be an iterable of tensors or dicts, got a single "
                              "tensor", hint="Pass model.parameters() or [tensor].")
        try:
            super().__init__(params, defaults)
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"invalid parameters for AdamW8bit: {exc}",
                              hint="Pass parameters as model.parameters() or a list of "
                                   "{'params': ..., 'lr': ...} dicts; see the torch "
                                   "message above for the entry at fault.") from exc

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (validated like the constructor's arguments).

        Args:
            param_group: a dict with ``"params"`` and optional hyperparameter overrides.
        """
        _validate_hyper({**self.defaults, **param_group})  # before the group is added
        super().add_param_group(param_group)
        for param in self.param_groups[-1]["params"]:
            if not param.is_floating_point() or param.is_complex():
                self.param_groups.pop()
                raise ConfigError(f"AdamW8bit optimizes floating-point tensors, got {param.dtype}",
                                  hint="Leave integer and complex tensors out of the parameter "
                                       "groups, e.g. filter with p.is_floating_point().")

    # -- inspection and checkpoints ----------------------------------------------------------

    def state_bytes(self) -> int:
        """Bytes of every state tensor (codes, per-block scales, fp32 states of small tensors
        and step counters): what this optimizer keeps besides the parameters and gradients."""
        return sum(value.nbytes for state in self.state.values() for value in state.values()
                   if isinstance(value, torch.Tensor))

    @torch.no_grad()
    def dequantized_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """The moments of ``param`` as fp32 tensors shaped like it (for inspection and tests).

        Args:
            param: a parameter of this optimizer that has been stepped at least once.

        Returns:
            ``{"exp_avg": m, "exp_avg_sq": v}``, new tensors on the parameter's device.

        Raises:
            ConfigError: when ``param`` has no state yet.
        """
        state = self.state.get(param)
        if not state:
            raise ConfigError("this parameter has no optimizer state yet",
                              hint="States are created by the first step() with a gradient.")
        numel = param.numel()
        if "exp_avg" in state:
            return {"exp_avg": state["exp_avg"].clone().view(param.shape),
                    "exp_avg_sq": state["exp_avg_sq"].clone().view(param.shape)}
        block_size, bits = state["block_size"], state["state_bits"]
        m = dequantize_blockwise(state["exp_avg_codes"], state["exp_avg_absmax"],
                                 codebook(SIGNED, bits, param.device), block_size)
        r = dequantize_blockwise(state["exp_avg_sq_sqrt_codes"], state["exp_avg_sq_sqrt_absmax"],
                                 codebook(UNSIGNED_NONZERO, bits, param.device), block_size)
        return {"exp_avg": m.view(-1)[:numel].view(param.shape),
                "exp_avg_sq": r.square_().view(-1)[:numel].view(param.shape)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (or from ``torch.optim.AdamW``).

        Unlike the base class, quantized codes and fp32 scales keep their dtypes (the base class
        would cast every tensor to the parameter's dtype); tensors move to the parameter's device,
        step counters stay on the CPU. fp32 moments (from small tensors, or from a
        ``torch.optim.AdamW`` checkpoint) are kept in fp32.

        Args:
            state_dict: the dict to load (not modified).

        Raises:
            ConfigError: when a stored layout does not fit its parameter.
        """
        saved_state = state_dict.get("state", {})
        super().load_state_dict({**state_dict, "state": {}})
        saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        by_id = dict(zip(saved_ids, params, strict=True))
        for key, saved in saved_state.items():
            param = by_id[key]
            state: dict[str, Any] = {}
            for name, value in saved.items():
                if not isinstance(value, torch.Tensor):
                    state[name] = value
                elif name == "step":
                    state[name] = value.detach().to("cpu", torch.float32, copy=True)
                elif name in _FULL_KEYS:
                    state[name] = value.detach().to(param.device, torch.float32,
                                                    copy=True).reshape(-1)
                else:
                    state[name] = value.detach().to(param.device, copy=True)
            self._check_layout(param, state)
            self.state[param] = state

    @staticmethod
    def _check_layout(param: torch.Tensor, state: dict[str, Any]) -> None:
        numel = param.numel()
        if "exp_avg" in state:
            sizes = {state[k].numel() for k in _FULL_KEYS if k in state}
            if sizes != {numel}:
                raise ConfigError(f"loaded fp32 moments have {sizes} elements for a parameter of "
                                  f"{numel}", hint="Load the state dict of the same model.")
            return
        missing = [k for k in (*_QUANTIZED_KEYS, "block_size", "state_bits") if k not in state]
        if missing:
            raise ConfigError(f"loaded optimizer state lacks {missing}",
                              hint="Load a state dict saved by AdamW8bit or torch AdamW.")
        block_size, bits = state["block_size"], state["state_bits"]
        padded = padded_numel(numel, block_size)
        expected = {"exp_avg_codes": padded * bits // 8, "exp_avg_sq_sqrt_codes": padded * bits // 8,
                    "exp_avg_absmax": padded // block_size,
                    "exp_avg_sq_sqrt_absmax": padded // block_size}
        for name, size in expected.items():
            if state[name].numel() != size:
                raise ConfigError(f"loaded {name} has {state[name].numel()} elements, expected "
                                  f"{size} for a parameter of {numel} (block_size {block_size}, "
                                  f"{bits} bits)", hint="Load the state dict of the same model.")

    # -- stepping ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *,  # type: ignore[override]
             gradients: Mapping[torch.Tensor, torch.Tensor] | None = None) -> Any:
        """One AdamW update of every parameter that has a gradient.

        Args:
            closure: optional, re-evaluates the model and returns the loss (run with grad
                enabled).
            gradients: optional ``{param: gradient}`` used instead of ``param.grad`` for those
                parameters (default ``None``). A gradient may have any floating dtype, e.g. an
                fp32 accumulator of a bf16 parameter, which ``param.grad`` cannot hold.

        Returns:
            The closure's loss, or ``None``.

        Raises:
            ConfigError: for a sparse gradient, or a group whose settings no longer match the
                layout of its stored states.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        override = gradients if gradients is not None else {}
        for group in self.param_groups:
            for param in group["params"]:
                grad = override.get(param, param.grad)
                if grad is not None:
                    if grad.shape != param.shape:
                        raise ConfigError(f"gradient of shape {tuple(grad.shape)} for a parameter "
                                          f"of shape {tuple(param.shape)}",
                                          hint="Give each gradient in gradients= the shape of its "
                                               "parameter (param.shape).")
                    self._step_param(param, grad, group)
        return loss

    def _step_param(self, param: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        if grad.is_sparse:
            raise ConfigError("AdamW8bit does not support sparse gradients",
                              hint="Use torch.optim.SparseAdam for sparse embeddings.")
        state = self.state[param]
        if not state:
            self._init_state(param, state, group)
        state["step"] += 1
        step = float(state["step"])  # a CPU tensor: reading it never waits for the GPU
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = float(group["lr"]), float(group["eps"]), group["weight_decay"]
        bias_correction1 = 1 - beta1 ** step
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5  # as torch.optim.AdamW computes it
        hyper = (beta1, beta2, lr, eps, weight_decay, lr / bias_correction1,
                 bias_correction2_sqrt)
        flat_grad = grad.reshape(-1)
        master = state.get("master")
        if master is not None:  # the fp32 copy is updated; the parameter gets its rounding
            self._update(master, flat_grad, state, hyper)
            param.copy_(master.view(param.shape))
            return
        contiguous = param.is_contiguous()
        target = param if contiguous else param.contiguous()
        self._update(target.view(-1), flat_grad, state, hyper)
        if not contiguous:
            param.copy_(target)

    def _update(self, flat_param: torch.Tensor, flat_grad: torch.Tensor, state: dict[str, Any],
                hyper: tuple[float, ...]) -> None:
        if "exp_avg" in state:
            self._full_precision_update(flat_param, flat_grad, state, hyper)
        else:
            self._quantized_update(flat_param, flat_grad, state, hyper)

    def _init_state(self, param: torch.Tensor, state: dict[str, Any],
                    group: dict[str, Any]) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        if group.get("master_weights") and param.dtype != torch.float32:
            state["master"] = param.detach().reshape(-1).to(torch.float32, copy=True)
        numel = param.numel()
        if numel < group["min_8bit_size"]:
            state["exp_avg"] = torch.zeros(numel, dtype=torch.float32, device=param.device)
            state["exp_avg_sq"] = torch.zeros(numel, dtype=torch.float32, device=param.device)
            return
        block_size, bits = group["block_size"], group["state_bits"]
        padded = padded_numel(numel, block_size)
        blocks = padded // block_size
        code_bytes = padded * bits // 8
        state["block_size"] = block_size
        state["state_bits"] = bits
        # All-zero codes/absmax dequantize to exact zeros with both books (absmax 0).
        state["exp_avg_codes"] = torch.zeros(code_bytes, dtype=torch.uint8, device=param.device)
        state["exp_avg_absmax"] = torch.zeros(blocks, dtype=torch.float32, device=param.device)
        state["exp_avg_sq_sqrt_codes"] = torch.zeros(code_bytes, dtype=torch.uint8,
                                                     device=param.device)
        state["exp_avg_sq_sqrt_absmax"] = torch.zeros(blocks, dtype=torch.float32,
                                                      device=param.device)

    @staticmethod
    def _decay_and_apply(flat_param: torch.Tensor, exp_avg: torch.Tensor, sqrt_sq: torch.Tensor,
                         hyper: tuple[float, ...]) -> None:
        """param = param * (1 - lr * wd) - step_size * m / (r / sqrt(bc2) + eps), in fp32."""
        _, _, lr, eps, weight_decay, step_size, bias_correction2_sqrt = hyper
        denom = (sqrt_sq / bias_correction2_sqrt).add_(eps)
        work = flat_param if flat_param.dtype == torch.float32 else flat_param.float()
        work.mul_(1 - lr * weight_decay)
        work.addcdiv_(exp_avg, denom, value=-step_size)
        if work is not flat_param:
            flat_param.copy_(work)

    def _full_precision_update(self, flat_param: torch.Tensor, flat_grad: torch.Tensor,
                               state: dict[str, Any], hyper: tuple[float, ...]) -> None:
        beta1, beta2 = hyper[0], hyper[1]
        grad = flat_grad.float()
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        self._decay_and_apply(flat_param, exp_avg, exp_avg_sq.sqrt(), hyper)

    def _quantized_update(self, flat_param: torch.Tensor, flat_grad: torch.Tensor,
                          state: dict[str, Any], hyper: tuple[float, ...]) -> None:
        beta1, beta2 = hyper[0], hyper[1]
        # The layout stored with the state is authoritative (a group may have been edited).
        block_size, bits = state["block_size"], state["state_bits"]
        m_codes, m_absmax = state["exp_avg_codes"], state["exp_avg_absmax"]
        r_codes, r_absmax = state["exp_avg_sq_sqrt_codes"], state["exp_avg_sq_sqrt_absmax"]
        m_book = codebook(SIGNED, bits, flat_param.device)
        r_book = codebook(UNSIGNED_NONZERO, bits, flat_param.device)
        if _use_fused_kernel(flat_param, flat_grad, block_size):
            from vramkit.optim import _triton_adamw  # triton is imported on the first CUDA step

            _triton_adamw.fused_quantized_update(flat_param, flat_grad, state, m_book, r_book,
                                                 hyper)
            return
        numel, blocks = flat_param.numel(), m_absmax.numel()
        blocks_per_chunk = max(1, _CHUNK_ELEMENTS // block_size)
        for first in range(0, blocks, blocks_per_chunk):
            last = min(first + blocks_per_chunk, blocks)
            start, stop = first * block_size, last * block_size
            valid = min(stop, numel) - start
            code_start, code_stop = start * bits // 8, stop * bits // 8
            grad = flat_grad[start:start + valid].float()
            if valid < stop - start:  # the last block's padding: a zero gradient
                grad = torch.nn.functional.pad(grad, (0, stop - start - valid))
            grad = grad.view(-1, block_size)
            exp_avg = dequantize_blockwise(m_codes[code_start:code_stop], m_absmax[first:last],
                                           m_book, block_size)
            sqrt_sq = dequantize_blockwise(r_codes[code_start:code_stop], r_absmax[first:last],
                                           r_book, block_size)
            exp_avg.lerp_(grad, 1 - beta1)
            # v = beta2 * r^2 + (1 - beta2) * g^2, kept as its square root.
            sqrt_sq.square_().mul_(beta2).addcmul_(grad, grad, value=1 - beta2).sqrt_()
            self._decay_and_apply(flat_param[start:start + valid],
                                  exp_avg.view(-1)[:valid], sqrt_sq.view(-1)[:valid], hyper)
            quantize_blockwise(exp_avg, m_book, m_codes[code_start:code_stop],
                               m_absmax[first:last])
            quantize_blockwise(sqrt_sq, r_book, r_codes[code_start:code_stop],
                               r_absmax[first:last])
