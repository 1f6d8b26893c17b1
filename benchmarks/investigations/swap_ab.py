"""Paired A/B of ``benchmarks/swap.py`` between two source trees (a refactor must not move it).

Runs the same ``swap.py`` arguments from tree A and tree B in alternating rounds (A B A B ...),
each run a fresh process with ``PYTHONPATH=<tree>/src`` and that tree's own
``benchmarks/swap.py``, then compares the rows they share (model, tokens, checkpointing, swapped
blocks):

* ``vramkit B/A``: the median vramkit step time of B over A's;
* ``overhead B/A``: B's vramkit/resident ratio over A's, both measured in the same runs, so
  drift of the machine between runs cancels;
* ``resident B/A``: the resident model's step time of B over A's (no vramkit code in the step
  but checkpointing): what the machine's drift alone looks like.

Run (GPU), the tree before a change unpacked in ``.ab/before`` (``git archive <rev> src
benchmarks``), about 5 minutes::

    python benchmarks/investigations/swap_ab.py --a .ab/before --b . --rounds 2 --out out/ab -- \\
        --dit off --tokens 2048 8192 --fractions 0.5 1.0 --exchange-budget 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the helpers
from _common import add_common_args, write_result

Key = tuple[str, int, bool, int]


def _run(tree: Path, label: str, round_index: int, args: list[str], out: Path) -> Path:
    target = out / f"{label}{round_index}.d"
    env = dict(os.environ, PYTHONPATH=str((tree / "src").resolve()), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(tree / "benchmarks" / "swap.py"), *args, "--out", str(target)]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    print(f"[{time.perf_counter() - started:6.1f}s] {label} round {round_index}: exit "
          f"{proc.returncode}", flush=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"swap.py from {tree} failed")
    # Keep only the JSON, flat: a machine that returns a few files gets every run.
    kept = out / f"{label}{round_index}.json"
    (target / "swap.json").replace(kept)
    for leftover in target.iterdir():
        leftover.unlink()
    target.rmdir()
    for key, row in sorted(_rows(kept).items()):
        print(f"    {label}{round_index} {key}: vramkit {row['vramkit']['step_ms']:.1f} ms, "
              f"resident {row['resident']['step_ms']:.1f} ms, "
              f"x{row['vramkit']['step_ms'] / row['resident']['step_ms']:.3f}", flush=True)
    return kept


def _rows(path: Path) -> dict[Key, dict[str, Any]]:
    data = json.loads(path.read_text())
    return {(r["model"], r["tokens"], r["checkpointing"], r["swapped"]): r for r in data["rows"]
            if r.get("vramkit") and r.get("resident")}


def compare(a_runs: list[dict[Key, dict[str, Any]]], b_runs: list[dict[Key, dict[str, Any]]]
            ) -> list[dict[str, Any]]:
    """Per shared row: medians over rounds of vramkit and resident step times, and ratios."""
    keys = sorted(set.intersection(*(set(r) for r in a_runs + b_runs)))
    rows = []

    def med(runs: list[dict[Key, dict[str, Any]]], key: Key, part: str) -> float:
        return statistics.median(r[key][part]["step_ms"] for r in runs)

    def overhead(runs: list[dict[Key, dict[str, Any]]], key: Key) -> float:
        return statistics.median(r[key]["vramkit"]["step_ms"] / r[key]["resident"]["step_ms"]
                                 for r in runs)

    for key in keys:
        a_v, b_v = med(a_runs, key, "vramkit"), med(b_runs, key, "vramkit")
        a_r, b_r = med(a_runs, key, "resident"), med(b_runs, key, "resident")
        rows.append({"model": key[0], "tokens": key[1], "checkpointing": key[2],
                     "swapped": key[3], "a_vramkit_ms": a_v, "b_vramkit_ms": b_v,
                     "a_resident_ms": a_r, "b_resident_ms": b_r,
                     "vramkit_b_over_a": b_v / a_v, "resident_b_over_a": b_r / a_r,
                     "overhead_a": overhead(a_runs, key), "overhead_b": overhead(b_runs, key),
                     "overhead_b_over_a": overhead(b_runs, key) / overhead(a_runs, key)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", type=Path, required=True, help="tree A (before)")
    parser.add_argument("--b", type=Path, required=True, help="tree B (after)")
    parser.add_argument("--rounds", type=int, default=2, help="A/B rounds (default 2)")
    add_common_args(parser)
    parser.add_argument("swap_args", nargs=argparse.REMAINDER,
                        help="arguments for swap.py, after --")
    args = parser.parse_args()
    swap_args = [a for a in args.swap_args if a != "--"]
    args.out.mkdir(parents=True, exist_ok=True)
    a_runs, b_runs = [], []
    started = time.perf_counter()
    for i in range(args.rounds):
        a_runs.append(_rows(_run(args.a, "a", i, swap_args, args.out)))
        b_runs.append(_rows(_run(args.b, "b", i, swap_args, args.out)))
    rows = compare(a_runs, b_runs)
    md_rows = [{"model": r["model"], "tokens": r["tokens"],
                "ckpt": "on" if r["checkpointing"] else "off", "swapped": r["swapped"],
                "A vramkit ms": round(r["a_vramkit_ms"], 1),
                "B vramkit ms": round(r["b_vramkit_ms"], 1),
                "vramkit B/A": round(r["vramkit_b_over_a"], 3),
                "resident B/A": round(r["resident_b_over_a"], 3),
                "overhead A": round(r["overhead_a"], 3), "overhead B": round(r["overhead_b"], 3),
                "overhead B/A": round(r["overhead_b_over_a"], 3)} for r in rows]
    write_result("swap_ab", {"a": str(args.a), "b": str(args.b), "rounds": args.rounds,
                             "swap_args": swap_args, "rows": rows,
                             "elapsed_s": time.perf_counter() - started}, md_rows, args.out)

if __name__ == "__main__":
    main()
