"""Checkpoint formats users bring, streamed into a swapped FLUX.1-dev: host memory, step time
and time to the first step against the bf16 single file.

The files (written by ``--part write`` into ``--workdir``, kept while their marker matches):
random FLUX.1-dev weights (matrices N(0, 0.02), norm scales 1, biases 0) in the layouts people
download, written tensor by tensor from the meta model's shapes (each drawn on the device,
copied out, written, freed):

* ``bf16``: ``flux1-dev.safetensors``, Black Forest Labs' single file (``double_blocks.0.
  img_attn.qkv.weight``...), bf16, 23.8 GB for the 12B model;
* ``gguf``: ``flux1-dev-Q8_0.gguf``, the same names as city96's ComfyUI-GGUF files: every
  matrix Q8_0 (quantized on the device: absmax/127 per block of 32, fp16 scale), vectors F32;
  12.7 GB;
* ``fp8``: ``flux1-dev-fp8_scaled.safetensors``, ComfyUI's fp8_scaled: ``model.diffusion_model.``
  names, matrices float8 e4m3 with a per-tensor ``.scale_weight`` (absmax/448), vectors bf16,
  the ``scaled_fp8`` marker; 11.9 GB.

Writing runs at the disk's write speed (about 1-2 GB/s on the GPU machine's local disk: the
bf16 file is the longest, 15-25 s); each format is written only when asked (``--formats``) and
missing. ``--layers N`` writes a model of N double and 2N single blocks (the full model: 19 and
38) so that a smaller stack fits the time a command may take.

The job (``benchmarks/swap_load.py``'s): peft LoRA r16 on ``to_q, to_k, to_v, to_out.0``,
1024x1024 (4096 image + 512 text tokens), batch 1, bf16 autocast, every block checkpointed,
AdamW on the adapters, under an 11.5 GiB cap with ``SwapConfig(max_gpu_bytes="6GiB")``. Each
variant runs in a fresh child process: ``FluxTransformer2DModel`` built on meta, then
``BlockSwapper(model, config, checkpoint=file)`` (the file opened by ``vramkit.io.formats``: the
qkv/linear1 row pieces read straight into the masters; GGUF bytes kept packed as
``GGUFLinear``; for ``fp8`` the model is first ``prepare_module(model, file,
QuantizationConfig("fp8"))``, so the file's e4m3 codes are the masters), LoRA
(``register_peft_lora`` for the packed bases), ``--steps`` steps.

Rounds: per round, per variant (in turn: bf16, gguf, fp8), the file's cold read (page cache
dropped, 8 threads of 64 MiB ``pread``) right before the child. Printed per child: peak RSS
(``VmHWM``) against file size + 3 GiB (target <= 1), time from the child's start (the command:
interpreter, imports, CUDA context included) to the end of its first step against the cold read
(target <= 1.15 for the bf16 single file; also printed from the start of the load, after the
imports), and the median
step after ``--warmup`` against the bf16 child's of the same round (target <= 1.10 for GGUF Q8_0
and fp8_scaled); the medians and spreads over the rounds at the end. With ``--example``, the
example from the bf16 file as well: where no plan is saved yet, once planning (and saving its
plan) and once more loading it, as a user's first and later runs; printed with the times at
which its imports, VAE and ``fit`` were done.

Run (GPU; diffusers, peft and nothing else beyond vramkit's own needs):
  PYTHONPATH=src python3 benchmarks/formats_load.py --part write --formats bf16,gguf,fp8
  PYTHONPATH=src python3 benchmarks/formats_load.py --part measure --rounds 2
  (smaller: --layers 4 on both; each command within ~4 minutes)
Run (CPU smoke): PYTHONPATH=src python3 benchmarks/formats_load.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_common_args, write_result
from _timing import log
from swap_load import (
    LORA_RANK,
    LORA_TARGETS,
    MAX_GPU_BYTES,
    TINY_TOKENS,
    adamw,
    flux_inputs,
    meta_model,
    model_config,
    peak_rss,
    process_age,
    train_step,
)
from vramkit.io._gguf_file import write_gguf
from vramkit.io._single_file import FLUX, LDM_PREFIX, original_names
from vramkit.io.disk import drop_page_cache

GIB = 1 << 30
CAP_GIB = 11.5
RSS_MARGIN = 3 * GIB
FORMATS = ("bf16", "gguf", "fp8")
FILES = {"bf16": "flux1-dev.safetensors", "gguf": "flux1-dev-Q8_0.gguf",
         "fp8": "flux1-dev-fp8_scaled.safetensors"}
TARGETS = {"peak RSS / (file + 3 GiB)": 1.0, "first step / cold read (bf16)": 1.15,
           "step / bf16 step": 1.10}
IMAGE_TOKENS, TEXT_TOKENS = 4096, 512
Q8_0, F32 = 8, 0


# -- the files ------------------------------------------------------------------------------------


def config_for(args: argparse.Namespace) -> dict[str, Any]:
    config = model_config(args.quick)
    if args.layers is not None:
        config["num_layers"] = args.layers
        config["num_single_layers"] = 2 * args.layers
    return config


def original_tensors(config: dict[str, Any], prefix: str = ""
                     ) -> list[tuple[str, tuple[int, ...]]]:
    """The single file's tensors (BFL names, shapes), in a model order."""
    model = meta_model(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    out = []
    for name, parts in original_names(FLUX, shapes, prefix=prefix).items():
        rows = sum(shapes[target][0] for target, _ in parts)
        out.append((name, (rows, *shapes[parts[0][0]][1:])))
    return out


def draw(name: str, shape: tuple[int, ...], device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    if len(shape) >= 2:
        return torch.randn(shape, generator=g, device=device) * 0.02
    if name.endswith("scale"):
        return torch.ones(shape, device=device)
    return torch.zeros(shape, device=device)


def q8_0_bytes(x: torch.Tensor) -> torch.Tensor:
    """GGML Q8_0 of ``x [rows, cols]`` on its device: blocks of 32 codes with an fp16 scale."""
    blocks = x.float().reshape(-1, 32)
    scale = (blocks.abs().amax(1, keepdim=True) / 127).to(torch.float16)
    codes = torch.where(scale.float() > 0, blocks / scale.float(), 0.0).round().clamp(-127, 127)
    return torch.cat([scale.view(torch.uint8), codes.to(torch.int8).view(torch.uint8)], dim=1)


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], str,
                                                        Callable[[], torch.Tensor]]]) -> int:
    """A safetensors file written tensor by tensor (header from the shapes first)."""
    widths = {"BF16": 2, "F32": 4, "F8_E4M3": 1}
    header: dict[str, Any] = {}
    offset = 0
    for name, shape, code, _ in tensors:
        nbytes = widths[code] * int(torch.Size(shape).numel())
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset,
                                                                             offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for _, _, _, make in tensors:
            f.write(make().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return f.tell()


def write_file(fmt: str, path: Path, config: dict[str, Any], device: torch.device,
               seed: int) -> int:
    prefix = LDM_PREFIX if fmt == "fp8" else ""
    tensors = original_tensors(config, prefix)
    if fmt == "bf16":
        return write_safetensors(path, [
            (n, s, "BF16", lambda n=n, s=s, i=i: draw(n, s, device, seed + i).bfloat16().cpu())
            for i, (n, s) in enumerate(tensors)])
    if fmt == "gguf":
        entries = []
        for i, (n, s) in enumerate(tensors):
            quant = len(s) == 2 and s[1] % 32 == 0
            entries.append((n, s, Q8_0 if quant else F32, (
                (lambda n=n, s=s, i=i: q8_0_bytes(draw(n, s, device, seed + i)).cpu().numpy())
                if quant else (lambda n=n, s=s, i=i: draw(n, s, device, seed + i).cpu().numpy()))))
        return write_gguf(path, entries, {"general.architecture": "flux"})
    entries_fp8: list[tuple[str, tuple[int, ...], str, Callable[[], torch.Tensor]]] = [
        ("scaled_fp8", (2,), "F8_E4M3", lambda: torch.zeros(2, dtype=torch.float8_e4m3fn))]
    for i, (n, s) in enumerate(tensors):
        if len(s) == 2:
            def weight(n: str = n, s: tuple[int, ...] = s, i: int = i) -> torch.Tensor:
                x = draw(n, s, device, seed + i)
                return (x / (x.abs().max() / 448)).to(torch.float8_e4m3fn).cpu()

            def scale(n: str = n, s: tuple[int, ...] = s, i: int = i) -> torch.Tensor:
                return (draw(n, s, device, seed + i).abs().max() / 448).reshape(()).float().cpu()

            base = n.removesuffix(".weight")
            entries_fp8 += [(n, s, "F8_E4M3", weight), (f"{base}.scale_weight", (), "F32", scale)]
        else:
            entries_fp8.append((n, s, "BF16", lambda n=n, s=s, i=i: draw(
                n, s, device, seed + i).bfloat16().cpu()))
    return write_safetensors(path, entries_fp8)


def marker(args: argparse.Namespace, fmt: str) -> dict[str, Any]:
    return {"format": fmt, "config": config_for(args), "seed": args.seed}


def file_ready(workdir: Path, fmt: str, expected: dict[str, Any]) -> bool:
    path, mark = workdir / FILES[fmt], workdir / f"{FILES[fmt]}.json"
    try:
        recorded = json.loads(mark.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (recorded.get("marker") == json.loads(json.dumps(expected)) and path.is_file()
            and path.stat().st_size == recorded.get("size"))


def write_part(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    written = {}
    for fmt in args.formats:
        expected = marker(args, fmt)
        if file_ready(workdir, fmt, expected):
            log(f"{fmt}: {FILES[fmt]} ready")
            continue
        t0 = time.perf_counter()
        size = write_file(fmt, workdir / FILES[fmt], config_for(args), device, args.seed)
        os.sync()
        seconds = time.perf_counter() - t0
        (workdir / f"{FILES[fmt]}.json").write_text(json.dumps({"marker": expected,
                                                               "size": size}))
        written[fmt] = {"bytes": size, "seconds": seconds, "gb_per_s": size / seconds / 1e9}
        log(f"{fmt}: wrote {size / 1e9:.2f} GB in {seconds:.1f} s")
    return written


# -- the child ------------------------------------------------------------------------------------


def cold_read(path: Path, threads: int = 8, chunk: int = 64 << 20) -> dict[str, Any]:
    from concurrent.futures import ThreadPoolExecutor

    dropped = drop_page_cache(path)
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)

    def read(offset: int) -> int:
        buf = bytearray(min(chunk, size - offset))
        got = os.preadv(fd, [buf], offset)
        os.posix_fadvise(fd, offset, got, os.POSIX_FADV_DONTNEED)
        return got

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(read, range(0, size, chunk)))
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
    return {"bytes": total, "seconds": seconds, "gb_per_s": total / seconds / 1e9,
            "page_cache_dropped": dropped}


def add_lora(model: torch.nn.Module, seed: int) -> list[torch.nn.Parameter]:
    """peft LoRA r16 on the targets (packed bases registered), values from ``seed``."""
    import peft

    from vramkit.quant.linear import register_peft_lora

    config = register_peft_lora(peft.LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK,
                                                target_modules=list(LORA_TARGETS)))
    peft.inject_adapter_in_model(config, model)
    g = torch.Generator().manual_seed(seed)
    params = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                scale = p.shape[1] ** -0.5 if "lora_A" in name else 1e-2
                p.data = (torch.randn(p.shape, generator=g) * scale).to(p.device)
                p.requires_grad_(True)
                params.append(p)
    return params


class _Context:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        if self.device.type == "cuda":
            torch.backends.cuda.enable_cudnn_sdp(False)  # illegal memory access (torch 2.11)
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total))
            torch.zeros(1, device=self.device)
        self.config = config_for(args)
        tokens = TINY_TOKENS if args.quick else (IMAGE_TOKENS, TEXT_TOKENS)
        self.inputs, self.target = flux_inputs(self.config, tokens, self.device, args.seed + 1)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def child(args: argparse.Namespace) -> None:
    r: dict[str, Any] = {"variant": args.variant, "status": "ok"}
    try:
        import diffusers  # noqa: F401  (before the clock, in every variant)
        import peft  # noqa: F401

        from vramkit.io.formats import prepare_module
        from vramkit.offload.checkpointing import enable_gradient_checkpointing
        from vramkit.offload.swap import BlockSwapper, SwapConfig
        from vramkit.quant.model import QuantizationConfig

        ctx = _Context(args)
        path = Path(args.workdir) / FILES[args.variant]
        r["file_bytes"] = path.stat().st_size
        t0 = time.perf_counter()
        r["load_from_start_s"] = process_age()  # the interpreter, imports, CUDA context
        model = meta_model(ctx.config)
        enable_gradient_checkpointing(model)
        if args.variant == "fp8":
            r["kept_fp8"] = len(prepare_module(model, path, QuantizationConfig("fp8")))
        max_gpu = args.max_gpu_bytes or (MAX_GPU_BYTES if not args.quick else "64MiB")
        swapper = BlockSwapper(model, config=SwapConfig(max_gpu_bytes=max_gpu),
                               device=ctx.device, checkpoint=path, progress=False)
        r["attach_s"] = time.perf_counter() - t0  # the swapper built (the fill may go on)
        params = add_lora(model, args.seed)
        opt = adamw(params, ctx.device)
        r["steps"], r["losses"] = [], []
        for i in range(args.steps):
            phases: dict[str, float] = {}
            r["losses"].append(train_step(ctx, model, opt, params, phases))
            r["steps"].append(phases)
            if i == 0:
                r["first_step_from_load_s"] = time.perf_counter() - t0
                r["first_step_from_start_s"] = process_age()
            log(f"{args.variant}: step {i + 1}: {phases['step_s']:.3f} s, "
                f"loss {r['losses'][-1]:.5f}")
        stats = swapper.stats()
        r["swapped_bytes"], r["pinned_bytes"] = stats.swapped_bytes, stats.pinned_bytes
        r["swapped_blocks"] = stats.swapped_blocks
        timed = [s["step_s"] for s in r["steps"][args.warmup:]] or [r["steps"][-1]["step_s"]]
        r["step_s"] = statistics.median(timed)
        r["peak_rss"] = peak_rss()
    except BaseException as exc:
        r["status"] = "error"
        r["error"] = f"{type(exc).__name__}: {str(exc)[:1500]}"
        r["traceback"] = traceback.format_exc()[-4000:]
        r["peak_rss"] = peak_rss()
        log(f"{args.variant}: {r['error'][:500]}")
    Path(args.child_out).write_text(json.dumps(r, default=str, indent=1), encoding="utf-8")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip freeing tens of GB of pinned memory one tensor at a time


# -- the parent -----------------------------------------------------------------------------------


def run_child(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    out = Path(args.workdir) / f"child-{variant}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--child-out",
           str(out), "--workdir", str(args.workdir), "--device", args.device,
           "--cap-gib", str(args.cap_gib), "--seed", str(args.seed), "--steps", str(args.steps),
           "--warmup", str(args.warmup)]
    if args.quick:
        cmd.append("--quick")
    if args.layers is not None:
        cmd += ["--layers", str(args.layers)]
    if args.max_gpu_bytes:
        cmd += ["--max-gpu-bytes", args.max_gpu_bytes]
    read = cold_read(Path(args.workdir) / FILES[variant])
    drop_page_cache(Path(args.workdir) / FILES[variant])
    log(f"{variant}: cold read {read['bytes'] / 1e9:.2f} GB in {read['seconds']:.1f} s; child")
    t0 = time.perf_counter()
    try:
        subprocess.run(cmd, timeout=args.child_timeout, check=False)
    except subprocess.TimeoutExpired:
        pass
    result = (json.loads(out.read_text(encoding="utf-8")) if out.exists()
              else {"variant": variant, "status": "crashed"})
    result["cold_read"] = read
    result["child_wall_s"] = time.perf_counter() - t0
    return result


#: FLUX.1-dev's VAE (its published config; random weights: only its shapes and time matter).
FLUX_VAE = dict(in_channels=3, out_channels=3, latent_channels=16,
                block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32,
                shift_factor=0.1159, scaling_factor=0.3611,
                use_quant_conv=False, use_post_quant_conv=False)
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_flux_lora.py"


def example_folder(args: argparse.Namespace) -> Path:
    """What ``examples/train_flux_lora.py`` reads beside the single file: the transformer's
    ``config.json``, a VAE folder and one captioned image (written once)."""
    folder = Path(args.workdir) / "example"
    ready = json.dumps(config_for(args), sort_keys=True)
    if (folder / "ready").is_file() and (folder / "ready").read_text() == ready:
        return folder
    from diffusers import AutoencoderKL

    sys.path.insert(0, str(EXAMPLE.parent))
    from tiny_models import write_images

    (folder / "transformer").mkdir(parents=True, exist_ok=True)
    (folder / "transformer" / "config.json").write_text(json.dumps(
        {"_class_name": "FluxTransformer2DModel", **config_for(args)}))
    vae = AutoencoderKL(**FLUX_VAE) if not args.quick else None
    if vae is None:  # the CPU smoke: the tiny models' VAE
        from tiny_models import FLUX_VAE as TINY_VAE
        vae = AutoencoderKL(**TINY_VAE)
    vae.save_pretrained(folder / "vae")
    write_images(folder / "images", count=1, size=32 if args.quick else 1024)
    (folder / "ready").write_text(ready)
    (folder / "plan.json").unlink(missing_ok=True)  # planned for another model
    return folder


def run_example(args: argparse.Namespace) -> dict[str, Any]:
    """The row "time from the examples/ command to the first step, FLUX from a single-file
    checkpoint": the bf16 file read cold, then the example run as a user would (its own
    process), its printed time against the cold read. Its ``--plan_file``: the first run
    plans (calibrating this GPU) and saves the plan, later runs load it, as a user's second
    run would."""
    import re

    folder = example_folder(args)
    plan_file = folder / "plan.json"
    planned = not plan_file.is_file()
    file = Path(args.workdir) / FILES["bf16"]
    resolution = 32 if args.quick else 1024
    budget = f"{args.cap_gib}GiB" if not args.quick else "64MiB"
    cmd = [sys.executable, str(EXAMPLE), "--pretrained_model_name_or_path", str(folder),
           "--transformer_file", str(file), "--instance_data_dir", str(folder / "images"),
           "--random_embeddings", "--output_dir", str(Path(args.workdir) / "example-out"),
           "--resolution", str(resolution), "--max_train_steps", "1",
           "--vram_budget", budget, "--checkpointing_steps", "1000000",
           "--plan_file", str(plan_file)]
    if args.device == "cpu":
        cmd += ["--cpu", "--mixed_precision", "no", "--hardware", "rtx4090"]
    read = cold_read(file)
    drop_page_cache(file)
    log(f"example: cold read {read['bytes'] / 1e9:.2f} GB in {read['seconds']:.1f} s; "
        f"{' '.join(cmd[1:3])} ...")
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, timeout=args.child_timeout, check=False, text=True,
                              capture_output=True)
        output, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        output, rc = str(exc.stdout or ""), None
    found = re.search(r"time from command to first step: ([0-9.]+) s", output)
    seconds = float(found.group(1)) if found else None
    stamps = [(float(t), what) for t, what in re.findall(r"^\[\s*([0-9.]+) s\] (.*)$", output,
                                                         flags=re.MULTILINE)]
    log(f"example: {'; '.join(f'{what} at {t:.1f} s' for t, what in stamps)}; first step at "
        f"{seconds} s (cold read {read['seconds']:.1f} s)")
    return {"variant": "example", "status": "ok" if found and rc == 0 else "failed",
            "returncode": rc, "planned_in_the_run": planned,
            "first_step_from_start_s": seconds, "stamps": stamps, "cold_read": read,
            "child_wall_s": time.perf_counter() - t0, "output_tail": output[-2000:]}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def measure_part(args: argparse.Namespace) -> dict[str, Any]:
    missing = [f for f in args.formats if not (Path(args.workdir) / FILES[f]).is_file()]
    if missing:
        raise SystemExit(f"missing files for {missing}: run --part write first")
    rounds = []
    for i in range(args.rounds):
        children = {variant: run_child(args, variant) for variant in args.formats}
        if args.example:  # a user's first run plans and saves the plan, later runs load it
            first = run_example(args)
            if first["planned_in_the_run"]:
                children["example (planning)"] = first
                first = run_example(args)
            children["example (saved plan)"] = first
        bf16 = children.get("bf16", {})
        for variant, r in children.items():
            r["rss_ratio"] = _ratio(r.get("peak_rss"), r.get("file_bytes", 0) + RSS_MARGIN)
            r["first_step_over_cold_read"] = _ratio(r.get("first_step_from_start_s"),
                                                    r["cold_read"]["seconds"])
            r["first_step_from_load_over_cold_read"] = _ratio(r.get("first_step_from_load_s"),
                                                              r["cold_read"]["seconds"])
            r["step_over_bf16"] = _ratio(r.get("step_s"), bf16.get("step_s"))
            log(f"round {i + 1} {variant}: {r['status']}, peak RSS {r.get('peak_rss') or 0:,} "
                f"(/ file + 3 GiB = {r['rss_ratio'] or 0:.3f}), first step / cold read "
                f"{r['first_step_over_cold_read'] or 0:.3f} (from the load's start "
                f"{r['first_step_from_load_over_cold_read'] or 0:.3f}), step "
                f"{r.get('step_s') or 0:.3f} s (/ bf16 {r['step_over_bf16'] or 0:.3f}); "
                f"load began {r.get('load_from_start_s') or 0:.1f} s after the start, swapper "
                f"built {r.get('attach_s') or 0:.1f} s later, first step "
                f"{r.get('first_step_from_load_s') or 0:.1f} s after the load began")
        rounds.append(children)
        # kept round by round: a run cut short by its time box keeps the rounds it finished
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "formats_load.rounds.json").write_text(
            json.dumps(rounds, indent=1, default=str), encoding="utf-8")
    summary = {}
    variants = list(dict.fromkeys(v for children in rounds for v in children))
    for variant in variants:
        def values(key: str, variant: str = variant) -> list[float]:
            return [r[variant][key] for r in rounds
                    if variant in r and r[variant].get(key) is not None]

        summary[variant] = {key: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                            for key in ("rss_ratio", "first_step_over_cold_read",
                                        "first_step_from_load_over_cold_read",
                                        "step_over_bf16", "step_s", "peak_rss")
                            if (v := values(key))}
    return {"rounds": rounds, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--part", choices=("write", "measure", "all"), default="all")
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help="comma-separated: bf16, gguf, fp8 (default all)")
    parser.add_argument("--workdir", default=os.environ.get("VRAMKIT_BENCH_WORKDIR",
                                                            "/tmp/vramkit_formats"))
    parser.add_argument("--layers", type=int, default=None,
                        help="N double and 2N single blocks (default: FLUX.1-dev's 19 and 38)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny FLUX, seconds on the CPU")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cap-gib", type=float, default=CAP_GIB)
    parser.add_argument("--max-gpu-bytes", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child-timeout", type=float, default=540)
    parser.add_argument("--example", action="store_true",
                        help="also time examples/train_flux_lora.py from the bf16 single file "
                             "to its first step (the row 'time from the examples/ command')")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = sorted(set(args.formats) - set(FORMATS))
    if unknown:
        parser.error(f"unknown formats {unknown}; choose from {', '.join(FORMATS)}")
    if args.child:
        args.variant = args.child
        child(args)
        return
    result: dict[str, Any] = {"targets": TARGETS, "formats": args.formats,
                              "config": config_for(args)}
    if args.part in ("write", "all"):
        result["written"] = write_part(args)
    rows = []
    if args.part in ("measure", "all"):
        result.update(measure_part(args))
        for variant, s in result["summary"].items():
            def cell(key: str, s: dict[str, Any] = s) -> str:
                v = s.get(key)
                return "-" if v is None else f"{v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})"

            rows.append({"format": variant, "file": FILES.get(variant, FILES["bf16"]),
                         "peak RSS / (file + 3 GiB)": cell("rss_ratio"),
                         "first step / cold read": cell("first_step_over_cold_read"),
                         "(from the load's start)": cell(
                             "first_step_from_load_over_cold_read"),
                         "step / bf16 step": cell("step_over_bf16"),
                         "step s": cell("step_s")})
    write_result("formats_load", result, rows or [{"written": json.dumps(result.get("written"))}],
                 Path(args.out))


if __name__ == "__main__":
    main()
