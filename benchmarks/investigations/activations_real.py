"""The activation estimate against real tensors: what the planner counts on meta for each block
beside what the same accounting records when the step runs for real under ``torch.autocast``,
and what the forward actually keeps allocated.

The model is a preset built from its published config with random weights (default
``flux-dev``, LoRA r16 on ``to_q, to_k, to_v, to_out.0``, 1024 x 1024), every block resident and
nothing checkpointed. Prints per block (one of each kind): bytes estimated on meta, bytes
recorded on the device, the difference; the sums over all blocks; and, on a GPU, the memory the
forward left allocated and the step's peak beside the estimate's ``full``. (The estimate follows
CUDA's autocast and fused kernels: on the CPU the real side takes CPU autocast's rules and the
float32 RMS norm, so the columns differ there by design.)

Run (GPU, ~1 min, needs ~55 GiB for FLUX.1-dev): PYTHONPATH=src python3
    benchmarks/investigations/activations_real.py --out out/activations
Run (CPU, code path only, a tiny model of the family): PYTHONPATH=src python3
    benchmarks/investigations/activations_real.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the helpers
from _common import add_common_args, write_result
from plan import fill_random, real_inputs, tiny_folder
from vramkit.offload.blocks import find_blocks
from vramkit.planning.activations import activation_accounting
from vramkit.planning.analysis import analyze
from vramkit.recipes.targets import build_target

FLUX_LORA = ["to_q", "to_k", "to_v", "to_out.0"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="flux-dev")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny model of the same family (flux-dev or llama-3.1-8b), "
                             "small inputs: a CPU smoke run")
    args = parser.parse_args()
    if args.tiny and not any(family in args.model for family in ("flux", "llama")):
        parser.error("--tiny has tiny models of flux-dev and llama-3.1-8b only")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)  # torch 2.11 + H100: illegal access
    flux = "flux" in args.model
    options: dict[str, Any] = {"lora_targets": FLUX_LORA} if flux else {}
    name: str = args.model
    if args.tiny:
        name = tiny_folder("flux" if flux else "llama")
        options.update({"resolution": 64, "seq_len": 8} if flux else {"seq_len": 64})
    target = build_target(name, **options)
    meta = analyze(target.model, target.inputs, step=target.step).activations

    model = build_target(name, **options).model
    model.to_empty(device=device)
    torch.manual_seed(0)
    fill_random(model)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    inputs = real_inputs(target.inputs, device, vocab, 1)
    names = [n for n, _ in find_blocks(model, "auto")]
    with activation_accounting(model, names) as saved:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = target.step(model, inputs)
    real = saved.estimate()
    del loss, saved

    kinds: dict[tuple[str, int], str] = {}  # first block of each (type, estimated bytes)
    for name in names:
        kinds.setdefault((type(model.get_submodule(name)).__name__, meta.per_block[name]), name)
    rows = []
    for (kind, _), name in kinds.items():
        rows.append({"block": name, "type": kind, "meta bytes": meta.per_block[name],
                     "real bytes": real.per_block[name],
                     "meta - real": meta.per_block[name] - real.per_block[name]})
    result: dict[str, Any] = {"model": args.model, "blocks": rows,
                              "sum_meta": sum(meta.per_block.values()),
                              "sum_real": sum(real.per_block.values()),
                              "outside_meta": meta.outside, "outside_real": real.outside,
                              "estimate_full": meta.full}
    if cuda:  # what the forward keeps for real, with no accounting in the way
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = target.step(model, inputs)
        torch.cuda.synchronize(device)
        result["kept_after_forward"] = torch.cuda.memory_allocated(device) - before
        loss.backward()
        torch.cuda.synchronize(device)
        result["step_peak"] = torch.cuda.max_memory_allocated(device) - before
    rows.append({"block": "all blocks", "type": "-", "meta bytes": result["sum_meta"],
                 "real bytes": result["sum_real"],
                 "meta - real": result["sum_meta"] - result["sum_real"]})
    write_result("activations_real", result, rows, args.out)


if __name__ == "__main__":
    main()
