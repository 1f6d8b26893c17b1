"""vramkit.planning.activations: activation bytes of a step by block, on the meta device."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vramkit.errors import ConfigError
from vramkit.planning.activations import ActivationEstimate, estimate_activations

TOKENS, DIM, HEADS = 256, 64, 4


class Attention(nn.Module):
    def __init__(self, keywords: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.keywords = keywords

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        if self.keywords:  # as diffusers' attention dispatcher calls it
            y = F.scaled_dot_product_attention(query=q, key=k, value=v)
        else:
            y = F.scaled_dot_product_attention(q, k, v)
        return x + self.out(y.transpose(1, 2).reshape(b, n, DIM))


def _model(keywords: bool = False) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*(Attention(keywords) for _ in range(3)))


def _estimate(model: nn.Module, batch: int = 1) -> ActivationEstimate:
    x = torch.empty(batch, TOKENS, DIM, device="meta", requires_grad=True)
    return estimate_activations(model, lambda: model(x).sum(), ["0", "1", "2"])


def _peak_by_formula(found: ActivationEstimate, checkpointed: set[str]) -> int:
    """What ``bytes_with`` computes, spelled out: at each block, what the blocks before keep
    plus the most of its forward and its backward; or everything kept and the tail."""
    kept = peak = 0
    for name, saved in found.per_block.items():
        forward = found.inputs[name] + found.transient[name]
        backward = found.backward_peak.get(name, saved + found.largest_block)
        peak = max(peak, kept + max(forward, backward))
        kept += found.inputs[name] if name in checkpointed else saved
    return found.outside + max(peak, kept + found.tail)


def test_blocks_inputs_and_attention_are_counted() -> None:
    found = _estimate(_model())
    assert set(found.per_block) == {"0", "1", "2"}
    # Each block's input is a [1, 256, 64] float32 tensor; block 0's is the leaf x.
    assert found.inputs == {"0": TOKENS * DIM * 4, "1": TOKENS * DIM * 4, "2": TOKENS * DIM * 4}
    # Fused attention saves q, k, v, the output and a log-sum-exp, never the L x L matrix.
    assert 0 < found.per_block["0"] < HEADS * TOKENS * TOKENS * 4
    assert found.per_block["0"] == found.per_block["1"] == found.per_block["2"]
    # The backward was followed: each block's holds at least what it saved (and the gradient
    # coming in), and no more than its saved tensors and everything its backward makes.
    assert set(found.backward_peak) == {"0", "1", "2"}
    for name, saved in found.per_block.items():
        assert saved + TOKENS * DIM * 4 <= found.backward_peak[name] < 3 * saved
    assert found.full == _peak_by_formula(found, set())
    assert found.checkpointed == _peak_by_formula(found, {"0", "1", "2"})
    assert found.checkpointed < found.full


def test_each_saved_tensor_dies_when_the_backward_has_used_it() -> None:
    """The three blocks are alike, but the last one's output gradient is the sum's broadcast
    (no storage), where the others get a real one: its backward holds exactly that much less.
    (While the follower's own frame still held the forward's last saved tensor -- here the
    last block's attention output, reshaped -- the three read the same.)"""
    found = _estimate(_model())
    peaks = found.backward_peak
    assert peaks["0"] == peaks["1"] == peaks["2"] + TOKENS * DIM * 4


class _Box:
    """An output structure the estimate's hooks do not open."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _Boxing(Attention):
    def forward(self, x: torch.Tensor) -> Any:  # type: ignore[override]
        return _Box(super().forward(x))


def test_a_block_the_backward_did_not_see_keeps_the_rule() -> None:
    """The last block returns its output in a structure the hooks do not open: no moment of
    its backward is known, so it is priced as before the backward was followed (what it saves
    and one block's worth of temporaries), not as its saved tensors alone."""
    with torch.device("meta"):
        model = nn.Sequential(Attention(False), Attention(False), _Boxing(False))
    x = torch.empty(1, TOKENS, DIM, device="meta", requires_grad=True)
    found = estimate_activations(model, lambda: model(x).t.sum(), ["0", "1", "2"])
    assert set(found.backward_peak) == {"0", "1"}
    assert found.full == _peak_by_formula(found, set())
    assert found.bytes_with(["0", "1"]) == _peak_by_formula(found, {"0", "1"})
    kept = found.per_block["0"] + found.per_block["1"]
    assert found.full == kept + found.per_block["2"] + found.largest_block


def test_without_a_followed_backward_one_block_stands_for_the_temporaries() -> None:
    found = _estimate(_model())
    bare = ActivationEstimate(found.per_block, found.inputs, found.outside)
    assert bare.full == bare.outside + sum(bare.per_block.values()) + bare.largest_block
    # Every block checkpointed: the peak is at the last block's recomputation, with the
    # inputs of the blocks before it kept.
    assert bare.checkpointed == (bare.outside + bare.inputs["0"] + bare.inputs["1"]
                                 + bare.per_block["2"] + bare.largest_block)


def test_any_set_of_checkpointed_blocks() -> None:
    found = _estimate(_model())
    assert found.bytes_with(()) == found.full
    assert found.bytes_with(["0", "1", "2"]) == found.checkpointed
    one = found.bytes_with(["1"])
    assert found.checkpointed < one < found.full
    assert one == _peak_by_formula(found, {"1"})
    # More checkpointing never raises the estimate.
    assert found.bytes_with(["0", "1"]) <= found.bytes_with(["1"]) <= found.bytes_with([])
    with pytest.raises(ConfigError, match="not blocks"):
        found.bytes_with(["7"])


def test_batch_scales_activations() -> None:
    one, two = _estimate(_model(), 1), _estimate(_model(), 2)
    assert two.full == pytest.approx(2 * one.full, rel=0.01)


def test_attention_called_with_keywords_is_counted_like_positional() -> None:
    assert _estimate(_model(keywords=True)) == _estimate(_model(keywords=False))


def test_unknown_block_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no block"):
        estimate_activations(_model(), lambda: None, ["9"])


def test_the_tail_after_the_last_block_is_counted() -> None:
    """A language model's logits and their float32 copy are alive when the forward turns into
    the backward, and autograd saves neither: the estimate holds them as its tail."""
    vocab = 4096
    with torch.device("meta"):
        model = nn.Sequential(*(Attention(False) for _ in range(3)), nn.Linear(DIM, vocab))
    x = torch.empty(1, TOKENS, DIM, device="meta", requires_grad=True)
    estimate = estimate_activations(model, lambda: model(x).float().mean(), ["0", "1", "2"])
    logits = TOKENS * vocab * 4  # float32 linear output (nothing casts it here)
    assert estimate.tail >= logits  # the logits (.float() of float32 returns them as they are)
    assert estimate.tail < 2 * logits
    everything = estimate.bytes_with(["0", "1", "2"])
    kept = sum(estimate.inputs.values())
    assert everything >= estimate.outside + kept + estimate.tail
    without_tail = ActivationEstimate(estimate.per_block, estimate.inputs, estimate.outside)
    assert without_tail.bytes_with(["0", "1", "2"]) < everything


def test_the_tail_is_its_peak_alive_not_the_sum_of_everything_it_made() -> None:
    """Temporaries freed before the logits exist (a final norm's float32 intermediates) do not
    add to the tail; tensors alive together do; one kept alive by a view counts until the view
    goes; one autograd saves counts as ``outside``, not in the tail."""
    vocab = 4096
    with torch.device("meta"):
        model = nn.Sequential(*(Attention(False) for _ in range(2)), nn.Linear(DIM, vocab))
    block_names = ["0", "1"]
    x = torch.empty(1, TOKENS, DIM, device="meta", requires_grad=True)
    head = model[2]
    trunk = nn.Sequential(model[0], model[1])
    logits32 = TOKENS * vocab * 4
    hidden32 = TOKENS * DIM * 4

    def step(temporaries: int, keep_view: bool) -> torch.Tensor:
        h = trunk(x)
        for _ in range(temporaries):  # made and dropped one after the other
            t = h.float() * 2.0
            del t
        view = (h.float() * 3.0).view(-1) if keep_view else None  # a base held by its view
        logits = head(h)  # float32: nothing casts it
        loss = (logits.float() * 1.0).mean()  # the copy and the logits alive together
        del view
        return loss

    def tail_of(temporaries: int, keep_view: bool) -> int:
        return estimate_activations(model, lambda: step(temporaries, keep_view),
                                    block_names).tail

    base = tail_of(0, False)
    assert 2 * logits32 <= base < 2 * logits32 + 2 * hidden32
    assert tail_of(8, False) == base  # eight temporaries, none alive at the peak
    assert tail_of(0, True) == base + hidden32  # the view keeps its base alive at the peak

    def then(kind: str) -> torch.Tensor:
        logits = head(trunk(x))
        if kind == "sin":
            return torch.sin(logits).mean()  # saves its input, made before it
        if kind == "exp":
            return torch.exp(logits).mean()  # saves its result, as it is made
        return (logits * 1.0).mean()  # saves nothing: both alive together

    plain, *saving = (estimate_activations(model, lambda k=k: then(k), block_names)
                      for k in ("plain", "sin", "exp"))
    for other in saving:  # what autograd saves is outside, and not in the tail
        assert plain.tail - other.tail == logits32 == other.outside - plain.outside


class _NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, dtype=torch.bfloat16)
        self.norm = nn.RMSNorm(DIM // HEADS, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x).view(*x.shape[:-1], HEADS, DIM // HEADS))


@pytest.mark.skipif(not hasattr(torch, "_fused_rms_norm"), reason="no fused RMS norm in torch")
class _Wide(nn.Module):
    """A feed-forward block whose hidden tensors are made and dropped in turn."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, hidden)
        self.down = nn.Linear(hidden, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)  # [.., hidden]
        g = F.gelu(h)  # h and g alive together
        del h
        return x + self.down(g)


@pytest.mark.parametrize("grad", [False, True])
def test_a_forward_without_autograd_holds_what_each_block_makes_at_once(grad: bool) -> None:
    hidden = 8 * DIM
    with torch.device("meta"):
        model = nn.Sequential(_Wide(hidden), _Wide(2 * hidden))
    model.requires_grad_(False)
    x = torch.empty(1, TOKENS, DIM, device="meta")

    def step() -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            return model(x)

    found = estimate_activations(model, step, ["0", "1"])
    if not grad:
        assert found.per_block == {"0": 0, "1": 0}  # nothing saved for a backward
    row = TOKENS * 4  # float32
    # the up projection and its GELU, alive together, then the down projection and the sum
    assert found.transient["0"] == 2 * row * hidden
    assert found.transient["1"] == 2 * row * 2 * hidden
    assert found.inputs["1"] == row * DIM  # block 0's output, not block 1's own
    assert found.inference_peak == found.inputs["1"] + found.transient["1"]
    assert ActivationEstimate({}, {}, 0).inference_peak == 0


def test_a_block_holds_its_attention_output_while_it_runs() -> None:
    model = _model()
    model.requires_grad_(False)
    x = torch.empty(1, TOKENS, DIM, device="meta")

    def step() -> torch.Tensor:
        with torch.no_grad():
            return model(x)

    found = estimate_activations(model, step, ["0", "1", "2"])
    row = TOKENS * 4 * DIM  # one float32 hidden state
    # at most alive together: qkv (3 wide, held by its q, k, v views), the attention's
    # output, the output projection and one more hidden state (the reshaped copy it reads,
    # then the residual sum): the fused kernel's stand-in counts like any other op (5 without)
    assert found.transient["1"] == 6 * row


def test_rms_norm_counts_what_the_fused_kernel_keeps() -> None:
    # On CUDA F.rms_norm runs the fused kernel, which keeps its input as given (bf16 here) and
    # a float32 1/rms per row; on meta tensors F.rms_norm decomposes into float32 ops that would
    # keep a float32 copy of the input too (FLUX's q/k norms: 57 MB a block more than an H100
    # keeps).
    with torch.device("meta"):
        model = nn.Sequential(_NormBlock())
    x = torch.empty(1, TOKENS, DIM, device="meta", dtype=torch.bfloat16, requires_grad=True)
    found = estimate_activations(model, lambda: model(x).float().sum(), ["0"])
    proj_input = TOKENS * DIM * 2  # the Linear keeps its input: x, the block's input
    norm_input, rstd = TOKENS * DIM * 2, TOKENS * HEADS * 4
    assert found.per_block["0"] == proj_input + norm_input + rstd


def test_flux_block_estimates_equal_what_an_h100_keeps() -> None:
    # The same accounting run on real tensors of FLUX.1-dev (LoRA r16 on to_q/k/v/out, 1024 px,
    # torch.autocast bf16) on an H100, torch 2.11: the bytes each block kept.
    pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    from vramkit.planning.analysis import analyze
    from vramkit.recipes.targets import build_target

    target = build_target("flux-dev", lora_targets=["to_q", "to_k", "to_v", "to_out.0"])
    found = analyze(target.model, target.inputs, step=target.step).activations
    measured = {"transformer_blocks.0": 441_196_544, "transformer_blocks.1": 499_834_880,
                "single_transformer_blocks.1": 427_094_016}
    assert {name: found.per_block[name] for name in measured} == measured
    assert sum(found.per_block.values()) == 25_667_796_992


def test_flux_inference_holds_a_single_blocks_transient_tensors() -> None:
    # What the planner's inference comment cites: at 1024 px a single
    # block makes 432 MiB alive at once beside its 27 MiB of inputs (a fitted forward on an
    # H200 peaked 3.1 % above a plan that priced 140 MiB). (486 MiB until the attention's
    # stand-in stopped holding its rotated q and k past the call.)
    pytest.importorskip("diffusers")
    from vramkit.planning.analysis import analyze
    from vramkit.recipes.targets import build_target

    target = build_target("flux-dev", mode="infer")
    found = analyze(target.model, target.inputs, step=target.step, mode="infer",
                    autocast=None).activations
    mib = 1 << 20
    single = "single_transformer_blocks.0"
    assert round(found.transient[single] / mib) == 432
    assert round(found.inputs[single] / mib) == 27
    assert round(found.inference_peak / mib) == 459
    assert found.largest_block + max(found.inputs.values()) < found.inference_peak / 3


def _stack_case() -> tuple[nn.Module, Any, Any, Any]:
    from tests.planning._models import inputs, stack

    def build() -> tuple[nn.Module, Any, list[nn.Parameter]]:
        model, batch = stack(), inputs()
        return model, (lambda: model(*batch).float().mean()), list(batch)

    return stack(device="meta"), inputs(device="meta"), build, lambda m, b: m(*b).float().mean()


def _dit_case() -> tuple[nn.Module, Any, Any, Any]:
    from vramkit.offload.blocks import find_blocks
    from vramkit.recipes.dit import DiT, DiTConfig, flow_matching_loss, synthetic_batch
    from vramkit.recipes.lora import add_lora_adapters

    config = DiTConfig.preset("tiny", dtype="bfloat16")

    def make(device: str) -> nn.Module:
        model = DiT(config, seed=0, device=device)
        for p in model.parameters():
            p.requires_grad_(False)
        add_lora_adapters(model, [n for n, _ in find_blocks(model)], 4)
        return model

    def build() -> tuple[nn.Module, Any, list[torch.Tensor]]:
        model = make("cpu")
        batch = synthetic_batch(config, 2, generator=torch.Generator().manual_seed(0))
        return model, (lambda: flow_matching_loss(model, batch)), list(batch.values())

    return (make("meta"), synthetic_batch(config, 2, device="meta"), build,
            flow_matching_loss)


@pytest.mark.parametrize("case", [_stack_case, _dit_case], ids=["stack", "dit"])
@pytest.mark.parametrize("share", [0.0, 0.5, 1.0], ids=["none", "half", "all"])
def test_the_estimate_is_the_live_peak_of_a_real_step(case: Any, share: float) -> None:
    """The bytes alive at once in a real CPU step (forward, loss, backward; the parameters'
    gradients left out, which the planner counts with the trainable state), followed tensor
    by tensor, against the estimate for the same checkpointed blocks: equal within 2 %, never
    below but for the loss's 4 bytes."""
    from tests.planning._live import live_peak
    from vramkit.offload.blocks import find_blocks
    from vramkit.offload.checkpointing import enable_gradient_checkpointing

    meta, meta_batch, build, loss = case()
    names = [n for n, _ in find_blocks(meta)]
    found = estimate_activations(meta, lambda: loss(meta, meta_batch), names)
    checkpointed = names[:round(share * len(names))]
    model, step, batch = build()
    if checkpointed:
        enable_gradient_checkpointing(model, checkpointed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    measured = live_peak(step, [*model.parameters(), *model.buffers(), *batch], trainable)
    predicted = found.bytes_with(checkpointed)
    assert measured - 4 <= predicted <= 1.02 * measured, (predicted, measured)


@pytest.mark.parametrize("share", [0.0, 1.0], ids=["none", "all"])
def test_parts_checkpointed_inside_blocks_are_estimated_as_a_real_step_holds(
        share: float) -> None:
    """Sub-block checkpointing (each block's ``attn1`` and ``ffn`` checkpointed on their own):
    the estimate follows the parts' recomputation in the backward -- under the fused stand-ins,
    entered again around it -- and equals a real CPU step's live peak within 4 %, never below
    (every block checkpointed: 2.9 % over, one hidden state -- the estimate takes a
    checkpointed block's recomputation to rebuild its output, which PyTorch's early stop does
    not)."""
    from tests.planning._live import live_peak
    from tests.planning._models import video_inputs, video_parts_model
    from vramkit.offload.checkpointing import enable_gradient_checkpointing
    from vramkit.offload.subblock import checkpoint_block_parts

    names = [f"blocks.{i}" for i in range(4)]
    meta, meta_batch = video_parts_model(), video_inputs(4, 16, 24, device="meta")
    checkpoint_block_parts(meta, names)
    found = estimate_activations(meta, lambda: meta(*meta_batch).float().mean(), names)
    plain = video_parts_model()
    as_built = estimate_activations(plain, lambda: plain(*meta_batch).float().mean(), names)
    checkpointed = names[:round(share * len(names))]
    assert found.bytes_with(checkpointed) < as_built.bytes_with(checkpointed)
    model, batch = video_parts_model(device="cpu"), video_inputs(4, 16, 24)
    checkpoint_block_parts(model, names)
    if checkpointed:
        enable_gradient_checkpointing(model, checkpointed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    measured = live_peak(lambda: model(*batch).float().mean(),
                         [*model.parameters(), *model.buffers(), *batch], trainable)
    predicted = found.bytes_with(checkpointed)
    assert measured - 4 <= predicted <= 1.04 * measured, (predicted, measured)
