"""Running a two-process job for the distributed tests: ``python -m torch.distributed.run``.

The jobs run on the CPU with gloo whatever the machine (``CUDA_VISIBLE_DEVICES`` is emptied), so
they check the same things everywhere; the GPU paths have their own ``multigpu`` tests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
WORKER = Path(__file__).resolve().parent / "_worker.py"
NPROC = 2
TIMEOUT_S = 600

# Set by an outer launcher (pytest itself run under torchrun or SLURM): the job below must be
# its own.
_INHERITED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
              "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def require_gloo() -> None:
    """Skip the calling module where torch.distributed or its gloo backend is missing."""
    import torch

    dist = torch.distributed
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with the gloo backend is not available",
                    allow_module_level=True)


def job_env(**extra: str) -> dict[str, str]:
    """The environment of a job: this checkout's ``src`` first on ``PYTHONPATH``, one OpenMP
    thread per rank (two ranks share the test machine), no GPU."""
    env = {k: v for k, v in os.environ.items() if k not in _INHERITED}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def tail(text: str, chars: int = 6000) -> str:
    return text if len(text) <= chars else "..." + text[-chars:]


def describe(proc: subprocess.CompletedProcess[str]) -> str:
    """The exit code and the end of both streams, for a failure message."""
    return (f"exit code {proc.returncode}\n--- stdout ---\n{tail(proc.stdout)}\n"
            f"--- stderr ---\n{tail(proc.stderr)}")


def torchrun(args: Sequence[str], *, cwd: Path, timeout: float = TIMEOUT_S,
             nproc: int = NPROC) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node <nproc> <args>``.

    A job still running after ``timeout`` seconds is killed with its ranks (its own session)
    and the test fails with what it printed.
    """
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc_per_node", str(nproc)], args, cwd=cwd, timeout=timeout)


def accelerate_launch(args: Sequence[str], *, cwd: Path, timeout: float = TIMEOUT_S,
                      nproc: int = NPROC) -> subprocess.CompletedProcess[str]:
    """``accelerate launch --multi_gpu --num_processes <nproc> <args>`` (Hugging Face's
    launcher: torchrun underneath, the same variables; ``--multi_gpu`` also runs CPU ranks when
    no GPU is visible). Its configuration is looked for under ``cwd`` (``HOME``), so the user's
    own is not read."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return _run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                 "--num_processes", str(nproc), "--num_machines", "1", "--mixed_precision",
                 "no", "--dynamo_backend", "no", "--main_process_port", str(port)], args,
                cwd=cwd, timeout=timeout, HOME=str(cwd))


def _run(launcher: list[str], args: Sequence[str], *, cwd: Path, timeout: float,
         **env: str) -> subprocess.CompletedProcess[str]:
    command = [*launcher, *args]
    proc = subprocess.Popen(command, cwd=cwd, env=job_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it started
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(args)} under {launcher[2]} ran past {timeout:.0f} s\n"
                    f"--- stdout ---\n{tail(stdout)}\n--- stderr ---\n{tail(stderr)}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)
