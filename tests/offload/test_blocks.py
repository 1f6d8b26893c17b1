"""Block discovery and spreading (vramkit.offload.blocks): natural ordering, automatic and named
block stacks, their errors, and the even spread of swapped blocks over bytes."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tests._toys import ResidualLinear, Stack
from vramkit.errors import ConfigError, OffloadError
from vramkit.offload.blocks import (
    BlockScheduleEntry,
    BlockSpec,
    find_blocks,
    module_bytes,
    natural_key,
    split_blocks,
    spread_evenly,
)

# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


class Block(ResidualLinear):
    pass


class SingleBlock(Block):
    pass


def _stack(n: int = 4, dim: int = 16) -> Stack:
    return Stack(lambda: Block(dim), n, inp=(dim, dim), out=(dim, dim), names=("embed", "head"))


class TwoStacks(nn.Module):
    """Flux layout: double blocks registered before single blocks, whose name sorts first."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer_blocks = nn.ModuleList(Block() for _ in range(2))
        self.single_transformer_blocks = nn.ModuleList(SingleBlock() for _ in range(3))


class NestedBlock(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))


def _names(found: list[tuple[str, nn.Module]]) -> list[str]:
    return [name for name, _ in found]


# --------------------------------------------------------------------------------------------
# natural_key, module_bytes, records
# --------------------------------------------------------------------------------------------


def test_natural_key_orders_numbers_as_numbers() -> None:
    names = ["blocks.10", "blocks.2", "blocks.1", "blocks.2.attn", "a.3", "blocks.02x"]
    ordered = sorted(names, key=natural_key)
    assert ordered.index("blocks.2") < ordered.index("blocks.10")
    assert ordered.index("blocks.1") < ordered.index("blocks.2")
    assert ordered.index("blocks.2") < ordered.index("blocks.2.attn")
    assert ordered[0] == "a.3"
    assert natural_key("blocks.2") < natural_key("blocks.10")
    assert "blocks.10" < "blocks.2"  # what plain text order would do


@given(st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=30, unique=True))
@settings(max_examples=50, deadline=None)
def test_natural_key_sorts_like_integers(indices: list[int]) -> None:
    names = [f"layers.{i}.block" for i in indices]
    assert sorted(names, key=natural_key) == [f"layers.{i}.block" for i in sorted(indices)]


def test_module_bytes_counts_shared_tensors_once() -> None:
    lin = nn.Linear(4, 8)  # 32 + 8 floats
    assert module_bytes(lin) == 40 * 4
    model = nn.Sequential(lin, lin)
    assert module_bytes(model) == 40 * 4
    model.register_buffer("table", torch.zeros(10, dtype=torch.float16))
    assert module_bytes(model) == 40 * 4 + 20


def test_block_spec_validates() -> None:
    assert BlockSpec("blocks.0", 0).nbytes == 0
    for name, nbytes in (("", 1), (3, 1), ("a", -1), ("a", 1.5), ("a", True)):
        with pytest.raises(ConfigError):
            BlockSpec(name, nbytes)  # type: ignore[arg-type]
    entry = BlockScheduleEntry(0, "blocks.0", 10, True)
    with pytest.raises(AttributeError):
        entry.swapped = False  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# find_blocks: auto
# --------------------------------------------------------------------------------------------


def test_auto_finds_a_plain_modulelist_stack() -> None:
    model = _stack(n=12)
    found = find_blocks(model)
    assert _names(found) == [f"blocks.{i}" for i in range(12)]  # blocks.2 before blocks.10
    assert all(module is model.blocks[i] for i, (_, module) in enumerate(found))


def test_auto_keeps_registration_order_of_two_stacks() -> None:
    found = _names(find_blocks(TwoStacks()))
    assert found == ["transformer_blocks.0", "transformer_blocks.1",
                     "single_transformer_blocks.0", "single_transformer_blocks.1",
                     "single_transformer_blocks.2"]


def test_auto_ignores_modulelists_nested_inside_blocks() -> None:
    model = nn.Module()
    model.blocks = nn.ModuleList(NestedBlock() for _ in range(3))
    assert _names(find_blocks(model)) == ["blocks.0", "blocks.1", "blocks.2"]


def test_auto_takes_a_sequential_with_repeated_children_and_skips_empty_ones() -> None:
    model = nn.Module()
    model.body = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 16),
                               nn.GELU(), nn.Linear(16, 16))
    # Every child with parameters is a block (the LayerNorm too); activations hold nothing.
    assert _names(find_blocks(model)) == ["body.0", "body.2", "body.3", "body.5"]


def test_auto_rejects_a_sequential_of_all_different_modules() -> None:
    model = nn.Module()
    model.body = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Conv1d(4, 4, 3))
    with pytest.raises(OffloadError) as info:
        find_blocks(model)
    assert "blocks=" in info.value.hint


def test_auto_ignores_a_tiny_modulelist() -> None:
    model = _stack(n=3, dim=64)
    model.tiny = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))  # far below 1% of the bytes
    assert _names(find_blocks(model)) == ["blocks.0", "blocks.1", "blocks.2"]
    only_tiny = nn.Module()
    only_tiny.big = nn.Linear(256, 256)
    only_tiny.tiny = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
    with pytest.raises(OffloadError):
        find_blocks(only_tiny)


def test_auto_on_a_model_without_stacks_raises() -> None:
    with pytest.raises(OffloadError) as info:
        find_blocks(nn.Linear(4, 4))
    assert info.value.hint


# --------------------------------------------------------------------------------------------
# find_blocks: names and patterns
# --------------------------------------------------------------------------------------------


def test_container_name_means_its_children() -> None:
    model = _stack(n=11)
    assert _names(find_blocks(model, ["blocks"])) == [f"blocks.{i}" for i in range(11)]
    assert _names(find_blocks(model, "blocks")) == [f"blocks.{i}" for i in range(11)]


def test_glob_pattern_dedupes_nested_matches() -> None:
    model = _stack(n=11)
    # "blocks.*" also matches blocks.3.fc: only the outer block is kept, in numeric order.
    found = find_blocks(model, ["blocks.*"])
    assert _names(found) == [f"blocks.{i}" for i in range(11)]
    assert len({id(m) for _, m in found}) == 11


def test_names_of_plain_modules_and_overlapping_requests() -> None:
    model = _stack(n=4)
    found = find_blocks(model, ["head", "blocks.1", "blocks", "embed"])
    # Registration order of the model, whatever order they were asked in; no duplicates.
    assert _names(found) == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    assert found[0][1] is model.embed


def test_two_named_stacks_keep_registration_order() -> None:
    found = _names(find_blocks(TwoStacks(), ["single_transformer_blocks", "transformer_blocks"]))
    assert found[:2] == ["transformer_blocks.0", "transformer_blocks.1"]
    assert found[2:] == [f"single_transformer_blocks.{i}" for i in range(3)]


def test_no_match_lists_containers_in_the_hint() -> None:
    with pytest.raises(OffloadError) as info:
        find_blocks(TwoStacks(), ["layers.*"])
    assert "layers.*" in info.value.message
    assert "transformer_blocks" in info.value.hint
    assert "single_transformer_blocks" in info.value.hint


@pytest.mark.parametrize("blocks", [3, [1, 2], None, ["blocks", 0]])
def test_bad_blocks_type_is_a_config_error(blocks: object) -> None:
    with pytest.raises(ConfigError):
        find_blocks(_stack(), blocks)  # type: ignore[arg-type]


def test_model_must_be_a_module() -> None:
    with pytest.raises(ConfigError):
        find_blocks("model")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# spread_evenly
# --------------------------------------------------------------------------------------------


@given(st.lists(st.integers(min_value=0, max_value=10**9), max_size=40),
       st.integers(min_value=-3, max_value=45))
@settings(max_examples=200, deadline=None)
def test_spread_evenly_basic_properties(sizes: list[int], count: int) -> None:
    chosen = spread_evenly(sizes, count)
    assert len(chosen) == min(max(count, 0), len(sizes))
    assert chosen == sorted(set(chosen))
    assert all(0 <= i < len(sizes) for i in chosen)


@given(st.integers(min_value=1, max_value=64), st.data())
@settings(max_examples=150, deadline=None)
def test_spread_evenly_equal_sizes_has_even_gaps(n: int, data: st.DataObject) -> None:
    count = data.draw(st.integers(min_value=1, max_value=n))
    size = data.draw(st.sampled_from([0, 1, 4096]))  # all-zero sizes count as equal
    chosen = spread_evenly([size] * n, count)
    gaps = [b - a for a, b in itertools.pairwise(chosen)]
    if gaps:
        assert max(gaps) - min(gaps) <= 1
        assert min(gaps) >= max(1, n // count - 1)
    if count >= 2:  # both ends swapped: the copy stream fills early and drains late
        assert chosen[0] == 0
        assert chosen[-1] == n - 1
    else:
        assert chosen == [(n - 1) // 2]


@pytest.mark.parametrize(("n", "count"), [(9, 5), (11, 6), (16, 6), (19, 10), (16, 16)])
def test_spread_evenly_exact_fits_are_uniform(n: int, count: int) -> None:
    # (n - 1) a multiple of (count - 1): the picks land on every ((n - 1) / (count - 1))th block.
    chosen = spread_evenly([4096] * n, count)
    gaps = {b - a for a, b in itertools.pairwise(chosen)}
    assert gaps == {(n - 1) // (count - 1)}


def test_spread_evenly_edges() -> None:
    assert spread_evenly([], 3) == []
    assert spread_evenly([5, 5, 5], 0) == []
    assert spread_evenly([5, 5, 5], -1) == []
    assert spread_evenly([5, 5, 5], 3) == [0, 1, 2]
    assert spread_evenly([5, 5, 5], 7) == [0, 1, 2]
    assert spread_evenly([1] * 8, 2) == [0, 7]
    assert spread_evenly([1] * 16, 8) == [0, 2, 4, 6, 9, 11, 13, 15]
    assert spread_evenly([1] * 5, 1) == [2]


def test_spread_evenly_follows_bytes_not_indices() -> None:
    # One huge block at the front holds most bytes: the midpoint target lands inside it.
    assert spread_evenly([1000, 1, 1, 1, 1], 1) == [0]
    assert spread_evenly([1, 1, 1, 1, 1000], 1) == [4]
    # Three of 2 big + 6 small blocks: the ends, and the block at the middle of the bytes
    # (block 1, which holds it) rather than the middle index.
    assert spread_evenly([100, 100, 1, 1, 1, 1, 1, 1], 3) == [0, 1, 7]


# --------------------------------------------------------------------------------------------
# the model itself as the stack
# --------------------------------------------------------------------------------------------


def test_auto_takes_the_model_when_it_is_the_stack() -> None:
    model = nn.Sequential(*(Block() for _ in range(4)))
    found = find_blocks(model)
    assert _names(found) == ["0", "1", "2", "3"]
    assert all(module is model[i] for i, (_, module) in enumerate(found))
    stack = nn.ModuleList(Block() for _ in range(3))
    assert _names(find_blocks(stack)) == ["0", "1", "2"]
    # A model that mixes an embedding, a stack and a head is searched inside, as before.
    mixed = nn.Sequential(nn.Linear(16, 16), nn.ModuleList(Block() for _ in range(3)),
                          nn.LayerNorm(16))
    assert _names(find_blocks(mixed)) == ["1.0", "1.1", "1.2"]


# --------------------------------------------------------------------------------------------
# diffusers UNets: each stage's resnets and attentions
# --------------------------------------------------------------------------------------------


class _Stage(nn.Module):
    def __init__(self, resnets: int, attentions: int) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(Block() for _ in range(resnets))
        if attentions:
            self.attentions = nn.ModuleList(SingleBlock() for _ in range(attentions))


class _UNetShaped(nn.Module):
    """The layout of diffusers' UNet2DConditionModel: ModuleLists of stages, a mid block."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_in = nn.Linear(16, 16)
        self.down_blocks = nn.ModuleList([_Stage(2, 0), _Stage(2, 2)])
        self.mid_block = _Stage(2, 1)
        self.up_blocks = nn.ModuleList([_Stage(3, 3), _Stage(3, 0)])


def test_unet_blocks_are_each_stages_resnets_and_attentions() -> None:
    from vramkit.offload.blocks import unet_blocks

    unet = _UNetShaped()
    assert unet_blocks(unet) == [
        "down_blocks.0.resnets", "down_blocks.1.resnets", "down_blocks.1.attentions",
        "mid_block.resnets", "mid_block.attentions", "up_blocks.0.resnets",
        "up_blocks.0.attentions", "up_blocks.1.resnets"]
    names = _names(find_blocks(unet))
    assert names[:4] == ["down_blocks.0.resnets.0", "down_blocks.0.resnets.1",
                         "down_blocks.1.resnets.0", "down_blocks.1.resnets.1"]
    assert "mid_block.attentions.0" in names and "up_blocks.1.resnets.2" in names
    assert len(names) == 2 + 4 + 3 + 6 + 3
    assert unet_blocks(_stack()) == []  # not a UNet: the generic rule applies
    assert _names(find_blocks(_stack())) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]


# --------------------------------------------------------------------------------------------
# split_blocks: finer swap units


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.mlp = nn.Linear(8, 16)
        self.act = nn.GELU()  # no tensors: not a unit


def test_split_blocks_puts_each_blocks_tensor_holding_children_in_its_place() -> None:
    model = nn.ModuleList([_Pair(), _Pair()])
    units = split_blocks(find_blocks(model))
    assert [n for n, _ in units] == ["0.attn", "0.mlp", "1.attn", "1.mlp"]
    assert units[0][1] is model[0].attn
    assert sum(module_bytes(m) for _, m in units) == module_bytes(model)


def test_split_blocks_keeps_whole_what_would_not_split_cleanly() -> None:
    single = nn.Sequential(nn.Linear(8, 8), nn.GELU())  # one child with tensors
    shared = _Pair()
    shared.mlp.weight = shared.attn.weight  # shared between children: counted once by the block
    shared.mlp.bias = shared.attn.bias
    found = [("single", single), ("shared", shared), ("plain", _Pair())]
    names = [n for n, _ in split_blocks(found)]
    assert names == ["single", "shared", "plain.attn", "plain.mlp"]


def test_split_blocks_opens_containers_and_leaves_a_blocks_own_tensors_resident() -> None:
    own = _Pair()
    own.scale = nn.Parameter(torch.ones(8))  # Wan's scale_shift_table: no unit holds it
    own.register_buffer("table", torch.ones(4))
    modulated = nn.Module()
    modulated.mod = nn.Sequential(nn.SiLU(), nn.Linear(8, 24))  # Qwen-Image's img_mod
    modulated.attn = nn.Linear(8, 8)
    nested = nn.Module()
    nested.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8)), nn.Linear(8, 8)])
    found = [("own", own), ("modulated", modulated), ("nested", nested)]
    units = split_blocks(found)
    assert [n for n, _ in units] == ["own.attn", "own.mlp", "modulated.mod.1", "modulated.attn",
                                     "nested.layers.0.0", "nested.layers.1"]
    assert units[2][1] is modulated.mod[1]
    model = nn.Module()
    for name, block in found:
        model.add_module(name, block)
    # every unit is found again by its name (none is a container that would expand)
    assert [n for n, _ in find_blocks(model, [n for n, _ in units])] == [n for n, _ in units]


def test_named_units_are_found_by_exact_name() -> None:
    model = nn.ModuleList([_Pair(), _Pair()])
    names = ["0.attn", "0.mlp", "1.attn", "1.mlp"]
    assert [n for n, _ in find_blocks(model, names)] == names
    with pytest.raises(OffloadError, match="no module matches ''"):
        find_blocks(model, [""])  # not the model itself


def test_auto_blocks_leave_out_a_lora_network_registered_on_the_model() -> None:
    from tests._toys import KohyaLoRANetwork

    model = Stack(lambda: nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)), 3,
                  seed=0)
    model.network = KohyaLoRANetwork(model, ["0", "2"], rank=4).apply_to()
    assert [n for n, _ in find_blocks(model)] == ["blocks.0", "blocks.1", "blocks.2"]
