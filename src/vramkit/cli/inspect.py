"""``vramkit inspect FILE_OR_DIR [--json] [--top N] [--list]``: what is in a checkpoint.

Reads only the headers (no tensor data) of a ``.safetensors`` file, a Hugging Face sharded
directory or a ``*.safetensors.index.json``, and prints the tensor count, parameters, bytes per
dtype, the largest tensors, and the memory the weights would need stored in bf16, fp8, int8 and
int4, and the file's ``__metadata__`` (LoRA training keys such as ``ss_network_dim``; long
values shortened in the table, whole in ``--json``).

Errors. A path that is not a checkpoint (a named pipe, a device, a symbolic-link loop, a
Hugging Face repo id, a diffusers pipeline root, a pickle checkpoint...) or a malformed
single file raises its :class:`~vramkit.errors.SafetensorsFormatError` (the ``vramkit`` command
prints it with its hint; exit code 1). In a sharded checkpoint, a shard that cannot be read is
left out and marked: the report covers the other shards, lists the bad ones (``errors`` in
JSON: file, error, hint; an ``ERROR`` row in the files table) and the exit code is 1.

Parameters. Only weights count: floating-point tensors, and each quantized weight a
:mod:`vramkit.quant` file declares (its original elements once, not its packed parts and
scales). Integer and bool tensors (position ids, masks, step counters) are shown apart as
"other tensors" (``other`` in JSON).

Memory estimates. Floating-point tensors with two or more dimensions (Linear/Conv weights,
embeddings) are counted in the quantized format; 1-D tensors (norms, biases) are counted in
bf16 and integer/bool tensors as stored. Bytes per element of each quantized format, scales
included, are :data:`QUANTIZED_BYTES_PER_ELEMENT`: measured by quantizing a 16x1024 sample with
:mod:`vramkit.quant` (the test suite checks them against it, so the command needs neither torch
nor vramkit.quant). Without them this arithmetic is used (per row of ``cols`` elements, groups
of 64): fp8 ``cols + 4`` (one fp32 scale per row), int8 ``cols + 4 * ceil(cols / 64)`` (fp32
scale per block), int4 ``ceil(cols / 2) + 4 * ceil(cols / 64)`` (packed nibbles, fp16 scale and
zero point per group).

Formats. A ``.gguf`` file (llama.cpp, ComfyUI-GGUF) is read from its header: tensors by GGML
type (``Q8_0``, ``Q4_K``, ``F32``...; the dtypes table), their bytes as stored, and its key-value
metadata (long arrays summarized). Every report names the format (``format`` in JSON,
:class:`vramkit.io.formats.CheckpointFormat`): the container, the single-file layout its names
are in (the original FLUX keys, bare or under ComfyUI's ``model.diffusion_model.``; SDXL's LDM
UNet) and whether it is ``fp8_scaled`` (float8 weights with per-tensor ``.scale_weight``).

Start-up. The command reads headers only, so it imports neither torch nor vramkit.quant:
``python -X importtime -m vramkit inspect FILE`` shows what it loads.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
from pathlib import Path
from typing import Any

__all__ = ["inspect_checkpoint", "register", "run"]

logger = logging.getLogger(__name__)

FORMATS = ("bf16", "fp8", "int8", "int4")
METADATA_VALUE_CHARS = 80  # longer metadata values are shortened in the table (JSON has them all)
_GROUP = 64
_SAMPLE_SHAPE = (16, 1024)  # ratios depend on the row length; few rows keep int4's search fast


def register(subparsers: Any) -> None:
    """Add the ``inspect`` sub-command to the ``vramkit`` parser."""
    parser = subparsers.add_parser(
        "inspect", help="list a safetensors checkpoint's tensors and memory needs",
        description="Read the headers of a .safetensors file, a sharded checkpoint directory or "
                    "a *.safetensors.index.json (no tensor data is read) and print its tensors, "
                    "dtypes, total bytes, the largest tensors, and the memory the weights need "
                    "in bf16, fp8, int8 and int4.")
    parser.add_argument("path", metavar="FILE_OR_DIR", help="checkpoint file, index or directory")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--top", metavar="N", type=int, default=10,
                        help="how many of the largest tensors to show (default 10)")
    parser.add_argument("--list", action="store_true",
                        help="list every tensor in the table output (JSON always lists them)")
    parser.set_defaults(func=run)


#: Bytes per element of each quantized format, scales included, for rows of 1024 elements:
#: ``quantize_tensor(sample, fmt).nbytes / sample.numel()`` for a 16x1024 float32 sample with
#: vramkit.quant's default configs (tests/cli/test_inspect.py checks these against it).
QUANTIZED_BYTES_PER_ELEMENT = {"fp8": 1.00390625, "int8": 1.03515625, "int4": 0.55078125}

# The __metadata__ key of a vramkit.quant file that declares its quantized weights.
_QUANT_LAYOUT_KEY = "vramkit.quant.layout"


def _format_bytes_per_element() -> tuple[dict[str, float] | None, str]:
    """Bytes/element of fp8/int8/int4 (``None`` to use the arithmetic), and their source."""
    return dict(QUANTIZED_BYTES_PER_ELEMENT), "measured"


def _quantized_bytes(fmt: str, shape: tuple[int, ...], ratios: dict[str, float] | None) -> int:
    numel = math.prod(shape)
    if ratios is not None:
        return math.ceil(numel * ratios[fmt])
    rows = shape[0]
    cols = numel // rows if rows else 0
    groups = math.ceil(cols / _GROUP)
    per_row = {"fp8": cols + 4, "int8": cols + 4 * groups,
               "int4": math.ceil(cols / 2) + 4 * groups}[fmt]
    return rows * per_row


def inspect_checkpoint(path: str) -> dict[str, Any]:
    """Everything ``vramkit inspect`` reports, as a JSON-ready dict.

    Args:
        path: a ``.safetensors`` file, a sharded directory or a ``*.safetensors.index.json``.

    Returns:
        ``path``, ``files`` (every file of the checkpoint, readable or not), ``num_tensors``,
        ``parameters`` (weights only, see the module docstring), ``other`` (the integer and
        bool tensors: tensors/elements/bytes), ``total_bytes``, ``dtypes`` (code ->
        tensors/elements/bytes),
        ``tensors`` (name, dtype, shape, bytes, file; in file order), ``memory`` (format ->
        bytes), ``ratio_source``, ``metadata`` and ``errors`` (one ``{"file", "error", "hint"}``
        per shard that could not be read; the other fields cover the readable shards).

    Raises:
        SafetensorsFormatError: for a path that is not a checkpoint or a malformed single file.
    """
    from vramkit.io.formats import detect_format, gguf_file
    from vramkit.io.lazy import LazySafetensors

    if gguf_file(path):
        return _inspect_gguf(path)
    with LazySafetensors.open(path, on_bad_shard="skip") as checkpoint:
        entries = checkpoint.entries()
        bad = checkpoint.bad_shards
        files = [str(f) for f in sorted([*checkpoint.files, *(b.path for b in bad)],
                                        key=_file_order(checkpoint))]
        metadata = checkpoint.metadata
    if bad and len(files) == 1:
        raise bad[0].error  # a single file: nothing else to show
    file_format = detect_format(path)
    ratios, source = _format_bytes_per_element()
    quantized_parts, parameters = _quantized_weights(metadata)
    dtypes: dict[str, dict[str, int]] = {}
    other = {"tensors": 0, "elements": 0, "bytes": 0}
    memory = dict.fromkeys(FORMATS, 0)
    tensors = []
    for entry in entries:
        info = dtypes.setdefault(entry.dtype_code, {"tensors": 0, "elements": 0, "bytes": 0})
        info["tensors"] += 1
        info["elements"] += entry.numel
        info["bytes"] += entry.nbytes
        tensors.append({"name": entry.name, "dtype": entry.dtype_code, "shape": list(entry.shape),
                        "bytes": entry.nbytes, "file": entry.path.name})
        floating = entry.is_floating_point
        if entry.name in quantized_parts:
            pass  # a part of a quantized weight: its weight's elements are counted once
        elif floating:
            parameters += entry.numel
        else:
            other["tensors"] += 1
            other["elements"] += entry.numel
            other["bytes"] += entry.nbytes
        for fmt in FORMATS:
            if not floating:
                memory[fmt] += entry.nbytes
            elif fmt == "bf16" or len(entry.shape) < 2 or entry.numel == 0:
                memory[fmt] += entry.numel * 2
            else:
                memory[fmt] += _quantized_bytes(fmt, entry.shape, ratios)
    return {
        "path": str(path),
        "format": _format_record(file_format),
        "files": files,
        "num_tensors": len(entries),
        "parameters": parameters,
        "other": other,
        "total_bytes": sum(e.nbytes for e in entries),
        "dtypes": dtypes,
        "tensors": tensors,
        "memory": memory,
        "ratio_source": source,
        "bytes_per_element": ratios,
        "metadata": metadata,
        "errors": [{"file": str(b.path), "error": b.error.message, "hint": b.error.hint}
                   for b in bad],
    }


def _format_record(fmt: Any) -> dict[str, Any]:
    return {"container": fmt.container, "layout": fmt.layout, "prefix": fmt.prefix,
            "fp8_scaled": fmt.fp8_scaled, "quant_types": fmt.quant_types,
            "description": fmt.describe()}


def _inspect_gguf(path: str) -> dict[str, Any]:
    """The report of a GGUF file: tensors by GGML type (quantized ones count their decoded
    elements as parameters), the layout its names are in, and its key-value metadata."""
    from vramkit.io._gguf_file import read_gguf_header
    from vramkit.io.formats import detect_format

    header = read_gguf_header(path)
    fmt = detect_format(path)
    ratios, source = _format_bytes_per_element()
    dtypes: dict[str, dict[str, int]] = {}
    memory = dict.fromkeys(FORMATS, 0)
    tensors = []
    parameters = 0
    other = {"tensors": 0, "elements": 0, "bytes": 0}
    for info in header.tensors:
        record = dtypes.setdefault(info.type_name, {"tensors": 0, "elements": 0, "bytes": 0})
        record["tensors"] += 1
        record["elements"] += info.numel
        record["bytes"] += info.nbytes
        tensors.append({"name": info.name, "dtype": info.type_name, "shape": list(info.shape),
                        "bytes": info.nbytes, "file": header.path.name})
        if info.type_name.startswith("I"):  # integer tensors: not weights
            other["tensors"] += 1
            other["elements"] += info.numel
            other["bytes"] += info.nbytes
            for fmt_name in FORMATS:
                memory[fmt_name] += info.nbytes
            continue
        parameters += info.numel
        for fmt_name in FORMATS:
            if fmt_name == "bf16" or len(info.shape) < 2 or info.numel == 0:
                memory[fmt_name] += info.numel * 2
            else:
                memory[fmt_name] += _quantized_bytes(fmt_name, info.shape, ratios)
    metadata = {key: value if isinstance(value, str) else json.dumps(value)
                for key, value in header.metadata.items()}
    return {
        "path": str(path), "format": _format_record(fmt), "files": [str(header.path)],
        "num_tensors": len(header.tensors), "parameters": parameters, "other": other,
        "total_bytes": sum(t.nbytes for t in header.tensors), "dtypes": dtypes,
        "tensors": tensors, "memory": memory, "ratio_source": source,
        "bytes_per_element": ratios, "metadata": metadata, "errors": [],
    }


def _quantized_weights(metadata: dict[str, str]) -> tuple[set[str], int]:
    """The tensors that are parts of quantized weights a vramkit.quant file declares, and the
    elements of those weights (their original shapes)."""
    raw = metadata.get(_QUANT_LAYOUT_KEY)
    if raw is None:
        return set(), 0
    try:
        layout = json.loads(raw)
        parts = {name for record in layout.values() for name in record["tensors"].values()}
        elements = sum(math.prod(int(d) for d in record["shape"]) for record in layout.values())
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        # a damaged layout: its parts are counted as what they are stored as
        logger.debug("unreadable %s metadata (%s): parts counted as stored", _QUANT_LAYOUT_KEY,
                     err)
        return set(), 0
    return parts, elements


def _file_order(checkpoint: Any) -> Any:
    """Sort key putting files in the order the checkpoint names them (its index's order, else
    natural name order: model-2 before model-10)."""
    if checkpoint.index is not None:
        order = {shard: i for i, shard in enumerate(checkpoint.index.shards)}
        return lambda path: (order.get(path, len(order)), path.name)
    return lambda path: [int(part) if part.isdigit() else part
                         for part in re.split(r"(\d+)", path.name)]


def run(args: argparse.Namespace) -> int:
    """Inspect the checkpoint and print JSON or tables; returns the exit code (1 when a shard
    could not be read)."""
    from vramkit._validate import check_int
    from vramkit.cli._output import flag_values

    with flag_values():  # a bad flag value is a usage error (exit code 2)
        check_int("--top", args.top, minimum=0, hint="Pass --top 0 or more (0 hides the largest "
                                                      "tensors table).")
    report = inspect_checkpoint(args.path)
    largest = sorted(report["tensors"], key=lambda t: t["bytes"], reverse=True)[:args.top]
    if args.json:
        from vramkit.cli._output import print_json

        print_json({**report, "largest": largest})
    else:
        _print_tables(report, largest, args.list)
    errors = report["errors"]
    if errors:
        import sys

        print(f"vramkit inspect: error: {len(errors)} of {len(report['files'])} shard file(s) "
              "could not be read and are left out of the totals ("
              + ", ".join(Path(e["file"]).name for e in errors) + ")", file=sys.stderr)
        return 1
    return 0


def _print_tables(report: dict[str, Any], largest: list[dict[str, Any]], list_all: bool) -> None:
    from rich.markup import escape
    from rich.table import Table

    from vramkit.cli._output import console
    from vramkit.units import format_size

    con = console()
    files = report["files"]
    other = report["other"]
    apart = (f" (+ {other['tensors']} other tensors (buffers: {other['elements']:,} elements, "
             f"{format_size(other['bytes'])}): integer and bool, not parameters)"
             if other["tensors"] else "")
    con.print(f"[bold]{escape(report['path'])}[/bold]: {report['num_tensors']} tensors in "
              f"{len(files)} file(s), {report['parameters']:,} parameters{escape(apart)}, "
              f"{format_size(report['total_bytes'])}")
    con.print(f"format: {escape(report['format']['description'])}")
    if report["errors"]:
        con.print(_files_table(report))
    dtypes = Table(title="dtypes")
    for column in ("dtype", "tensors", "elements", "bytes"):
        dtypes.add_column(column, justify="left" if column == "dtype" else "right")
    for code, info in sorted(report["dtypes"].items(), key=lambda kv: -kv[1]["bytes"]):
        dtypes.add_row(code, str(info["tensors"]), f"{info['elements']:,}",
                       format_size(info["bytes"]))
    con.print(dtypes)
    if largest:
        con.print(_tensor_table(f"largest {len(largest)} tensors", largest))
    memory = Table(title=f"weights memory by storage format ({report['ratio_source']} ratios; "
                         "1-D tensors in bf16)")
    # "vs. stored": against the file's bytes (a GGUF file's quantized tensors as stored)
    memory.add_column("format")
    memory.add_column("bytes", justify="right")
    memory.add_column("vs. stored", justify="right")
    for fmt, nbytes in report["memory"].items():
        ratio = nbytes / report["total_bytes"] if report["total_bytes"] else 0.0
        memory.add_row(fmt, format_size(nbytes), f"{ratio:.2f}x")
    con.print(memory)
    if report["metadata"]:
        con.print(_metadata_table(report["metadata"]))
    if list_all:
        con.print(_tensor_table("all tensors", report["tensors"]))


def _files_table(report: dict[str, Any]) -> Any:
    from rich.table import Table
    from rich.text import Text

    from vramkit.units import format_size

    errors = {e["file"]: e for e in report["errors"]}
    per_file: dict[str, list[int]] = {}
    for tensor in report["tensors"]:
        counts = per_file.setdefault(tensor["file"], [0, 0])
        counts[0] += 1
        counts[1] += tensor["bytes"]
    table = Table(title=f"files ({len(errors)} of {len(report['files'])} could not be read)")
    for column in ("file", "tensors", "bytes", "status"):
        table.add_column(column, justify="right" if column in ("tensors", "bytes") else "left")
    for file in report["files"]:
        name = Path(file).name
        error = errors.get(file)
        if error is None:
            tensors, nbytes = per_file.get(name, [0, 0])
            table.add_row(Text(name), str(tensors), format_size(nbytes), Text("ok"))
        else:
            status = Text("ERROR ", style="bold red")
            status.append(_strip_path(error["error"], file))
            status.append(f"\nhint: {error['hint']}", style="dim")
            table.add_row(Text(name, style="red"), "-", "-", status)
    return table


def _strip_path(message: str, file: str) -> str:
    prefix = f"{file}: "
    return message[len(prefix):] if message.startswith(prefix) else message


def _metadata_table(metadata: dict[str, str]) -> Any:
    from rich.table import Table
    from rich.text import Text

    shortened = 0
    table = Table(title=f"metadata (__metadata__, {len(metadata)} key(s))")
    table.add_column("key")
    table.add_column("value", overflow="fold")
    for key, value in metadata.items():
        shown = value.replace("\r", "\\r").replace("\n", "\\n")
        if len(shown) > METADATA_VALUE_CHARS:
            shortened += 1
            shown = (f"{shown[:METADATA_VALUE_CHARS]}... (+{len(shown) - METADATA_VALUE_CHARS} "
                     "chars)")
        table.add_row(Text(key), Text(shown))
    if shortened:
        table.caption = (f"{shortened} long value(s) shortened to {METADATA_VALUE_CHARS} "
                         "characters; --json shows them whole")
    return table


def _tensor_table(title: str, tensors: list[dict[str, Any]]) -> Any:
    from rich.table import Table
    from rich.text import Text

    from vramkit.units import format_size

    table = Table(title=title)
    for column in ("name", "dtype", "shape", "bytes"):
        table.add_column(column, justify="right" if column == "bytes" else "left")
    for tensor in tensors:
        # Text, not markup: a tensor named "[bold]" or "[/x]" is shown as it is
        table.add_row(Text(tensor["name"]), tensor["dtype"], str(tensor["shape"]),
                      format_size(tensor["bytes"]))
    return table
