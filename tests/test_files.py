"""Atomic writes (``vramkit._files``) and every writer that uses them: a writer stopped midway
(an exception, or SIGKILL in a child process) leaves the previous file whole, and the next write
works and deletes what the killed one left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._child import SRC
from vramkit._files import atomic_open, atomic_path, leftover_temporaries, new_temporary


def test_a_write_that_raises_midway_leaves_the_previous_file_and_no_temporary(
        tmp_path: Path) -> None:
    path = tmp_path / "out.bin"
    with atomic_open(path, "wb") as f:
        f.write(b"old")
    with pytest.raises(RuntimeError), atomic_open(path, "wb") as f:
        f.write(b"half of the new")
        raise RuntimeError("stopped midway")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]
    with atomic_path(path) as temporary:
        assert temporary.parent == tmp_path and temporary.name.startswith(".out.bin.")
        assert not temporary.name.endswith(".bin")  # no reader globbing *.bin finds it
        temporary.write_bytes(b"new")
        assert path.read_bytes() == b"old"  # renamed only when the block ends
    assert path.read_bytes() == b"new"
    with pytest.raises(ValueError, match="mode"), atomic_open(path, "a"):
        pass


def test_a_dead_writer_s_temporary_is_deleted_by_the_next_write_and_a_live_one_s_kept(
        tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = tmp_path / f".plan.json.{int(gone.stdout)}.abc123.tmp"
    dead.write_text('{"half')
    live = tmp_path / f".plan.json.{os.getppid()}.def456.tmp"  # the parent is running
    live.write_text('{"being written')
    other = tmp_path / f".other.json.{int(gone.stdout)}.x.tmp"  # another target's: not ours
    other.write_text("")
    assert leftover_temporaries(path) == [dead]
    with atomic_open(path) as f:
        f.write("{}")
    assert path.read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["plan.json", live.name, other.name])
    fd, temporary = new_temporary(path)
    os.close(fd)
    assert temporary.name.startswith(f".plan.json.{os.getpid()}.")


# --- SIGKILL while writing, one child per kind of file ------------------------------------------

_PREAMBLE = """
    import os, sys, time
    from pathlib import Path

    def hold(*args, **kwargs):  # the write is done up to its last step: stop here to be killed
        print("writing", flush=True)
        time.sleep(600)

    path = Path(sys.argv[1])
"""

_WRITERS = {
    # the bytes are written under a temporary name; the kill comes before the rename
    "plan": """
        from vramkit.planning.record import Plan, PhaseTime
        os.replace = hold
        phase = PhaseTime(2.0, 1.0, 0.5, 1 << 20)
        Plan("train", "rtx4090", 2 << 30, 0, ("b.1",), ("b.0",), (), 2, "bf16", "bf16", False,
             1 << 30, {}, phase, phase, 0.1, 0.0, 1 << 20).save(path)
    """,
    "report": """
        from tests.observe.test_report import _synthetic
        from vramkit.observe.report import save_report
        os.replace = hold
        save_report(_synthetic(7), path)
    """,
    "checkpoint": """
        import torch
        from vramkit.quant import QuantizationConfig, quantize_model, save_quantized
        torch.manual_seed(7)
        os.replace = hold
        save_quantized(quantize_model(torch.nn.Linear(256, 256), QuantizationConfig("int8")),
                       path)
    """,
    # the disk tier's spill file: killed after creating it and before unlinking it (the only
    # moment it has a name)
    "spill": """
        import torch
        from vramkit.offload.swap import BlockSwapper, SwapConfig
        from tests.offload.swap.test_source import _reference
        os.unlink = hold
        BlockSwapper(_reference(), device="cpu", config=SwapConfig(
            min_param_bytes=1024, host_budget=3 * 65536, disk_cache_dir=str(path.parent)))
    """,
}


def _kill_while_writing(kind: str, path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(SRC), str(SRC.parent), os.environ.get("PYTHONPATH")) if p)}
    code = textwrap.dedent(_PREAMBLE) + textwrap.dedent(_WRITERS[kind])
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline() if proc.stdout is not None else ""
        assert line.strip() == "writing", proc.communicate(timeout=60)[1][-3000:]
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate(timeout=60)  # reaped: its process id is gone


def _write(kind: str, path: Path, seed: int) -> bytes | None:
    """Write ``kind`` in this process; returns what a reader of ``path`` sees."""
    if kind == "plan":
        from vramkit.planning.record import PhaseTime, Plan

        phase = PhaseTime(float(seed), 1.0, 0.5, 1 << 20)
        Plan("train", "rtx4090", 2 << 30, 0, ("b.1",), ("b.0",), (), 2, "bf16", "bf16", False,
             1 << 30, {}, phase, phase, 0.1, 0.0, 1 << 20).save(path)
        return _read(kind, path)
    if kind == "report":
        from tests.observe.test_report import _synthetic
        from vramkit.observe.report import save_report

        save_report(_synthetic(seed), path)
        return _read(kind, path)
    if kind == "checkpoint":
        import torch

        from vramkit.quant import QuantizationConfig, quantize_model, save_quantized

        torch.manual_seed(seed)
        save_quantized(quantize_model(torch.nn.Linear(256, 256), QuantizationConfig("int8")),
                       path)
        return _read(kind, path)
    import torch

    from tests.offload.swap.test_source import _reference
    from vramkit.offload.swap import BlockSwapper, SwapConfig

    model = _reference()
    with BlockSwapper(model, device="cpu", config=SwapConfig(
            min_param_bytes=1024, host_budget=3 * 65536, disk_cache_dir=str(path.parent))
                      ) as swapper:
        assert swapper.stats().disk_blocks > 0
        model(torch.randn(3, 16)).sum().backward()
    return None


@pytest.mark.parametrize("kind", list(_WRITERS))
def test_a_writer_killed_midway_leaves_the_previous_file_and_the_next_write_works(
        kind: str, tmp_path: Path) -> None:
    path = tmp_path / {"plan": "plan.json", "report": "report.json",
                       "checkpoint": "model.safetensors", "spill": "unused"}[kind]
    before = _write(kind, path, seed=3)
    _kill_while_writing(kind, path)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == (1 if kind == "spill" else 2), left  # the killed run's temporary
    if kind != "spill":
        assert _read(kind, path) == before  # the previous file, whole
    after = _write(kind, path, seed=5)  # the next write works, and deletes the leftover
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ([] if kind == "spill" else [path.name]), names
    if kind != "spill":
        assert after != before


def _read(kind: str, path: Path) -> bytes:
    if kind == "plan":
        from vramkit.planning.record import Plan

        return Plan.load(path).to_json().encode()
    if kind == "report":
        from vramkit.observe.report import load_report

        return repr(load_report(path)).encode()
    from vramkit.quant import load_quantized

    return b"".join(t.tensors()["data"].numpy().tobytes() if hasattr(t, "tensors")
                    else t.numpy().tobytes() for t in load_quantized(path).values())
