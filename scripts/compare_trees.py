"""Two checkouts of checkfree side by side: is a change slower?

    python scripts/compare_trees.py --old ../old-checkout --new . --sizes 10,100 --repeats 3
    checkfree compare-trees --old ../old-checkout --sizes 10 --repeats 1 --spares 1

Runs `bench.py peers`' checkfree job (1 stage x 2 replicas, 4 x Linear(w, w) + ReLU, AdamW,
replica 1 SIGKILLed mid-step: scripts/peers.py) from each tree in turn -- old, new, old,
new, ... so that the machine's faster and slower minutes fall on both alike -- each run a
fresh process with that tree first on its path (its Ray workers inherit it), cold
replacement and warm spare. Prints, per size and spare setting, the steady step and kill
-> both training again of each tree (median, min-max) and the new tree's ratio to the
old, then where the recovery's time went (its breakdown). Every figure is measured by this
run, on this machine. It needs both checkouts and scripts/peers.py, so it stays a file of
scripts/ (``checkfree compare-trees`` runs it from the checkout).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from recovery.cli.help import HelpFormatter

_CHILD = """
import json, os, sys, tempfile
from pathlib import Path
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
import peers, torch
torch.set_num_threads(1)
try:
    from recovery.groups.ray_env import connect
except ImportError:  # a tree from before recovery/groups/ (d5cff68 and older)
    from recovery.ray_env import connect
connect()
with tempfile.TemporaryDirectory() as tmp:
    steady, back = peers.run_checkfree(int(sys.argv[1]), int(sys.argv[2]), Path(tmp))
print(json.dumps({"steady": steady, "back": back, **peers.RECOVERIES[-1].breakdown}))
"""


def _run(tree: Path, width: int, spares: int) -> dict[str, float]:
    tree = tree.resolve()
    env = {
        **os.environ,
        "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'scripts'}",
        "RAY_AUTH_MODE": "disabled",
    }
    env.pop("RAY_ADDRESS", None)
    with tempfile.TemporaryDirectory() as cwd:  # nothing of this checkout on the path by accident
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, str(width), str(spares)],
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd,
            timeout=900,
            check=False,
        )
    if out.returncode != 0:
        raise RuntimeError(f"{tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--old", type=Path, required=True, help="the checkout to compare against (required)"
    )
    p.add_argument("--new", type=Path, default=Path("."), help="the checkout under test")
    p.add_argument("--sizes", default="10,100", help="parameter megabytes, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="runs per tree, size and spare setting")
    p.add_argument(
        "--spares", default="0,1", help="hot spares per run, comma-separated (0: cold, 1: warm)"
    )
    args = p.parse_args(argv)
    spec = importlib.util.spec_from_file_location(
        "_checkfree_script_peers", Path(__file__).resolve().with_name("peers.py")
    )
    assert spec is not None and spec.loader is not None
    peers = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = peers
    spec.loader.exec_module(peers)

    trees = {"old": args.old, "new": args.new}
    for name, tree in trees.items():
        if not (tree / "recovery" / "__init__.py").exists():
            p.error(f"--{name} {tree} is not a checkfree checkout (no recovery/ there)")
    results: dict[tuple[int, int, str], list[dict[str, float]]] = {}
    for size in [int(s) for s in args.sizes.split(",") if s]:
        width = peers.WIDTHS.get(size) or int(((size * 2**20 / 4) / 4) ** 0.5)
        for rep in range(args.repeats):
            for spares in [int(s) for s in args.spares.split(",") if s]:
                for name, tree in trees.items():
                    print(
                        f"[{size} MB, spares {spares}] {name} run {rep + 1}/{args.repeats}",
                        file=sys.stderr,
                        flush=True,
                    )
                    results.setdefault((size, spares, name), []).append(_run(tree, width, spares))
    print(
        f"\ncheckfree, old ({args.old}) and new ({args.new}) trees in turn: bench.py peers' job, "
        f"medians of {args.repeats} (min-max), seconds"
    )
    print("| size | replacement | tree | steady step | new/old | kill -> both training | new/old |")
    print("|---|---|---|---|---|---|---|")
    for size, spares, name in sorted(results, key=lambda k: (k[0], k[1], k[2] != "old")):
        runs = results[(size, spares, name)]
        old = results[(size, spares, "old")]
        steady = [r["steady"] for r in runs]
        back = [r["back"] for r in runs]
        ratio_steady = statistics.median(steady) / statistics.median([r["steady"] for r in old])
        ratio_back = statistics.median(back) / statistics.median([r["back"] for r in old])
        kind = "warm spare" if spares else "cold"
        print(
            f"| {size} MB | {kind} | {name} | {_fmt(steady)} | {ratio_steady:.2f} | "
            f"{_fmt(back)} | {ratio_back:.2f} |"
        )
    phases = ("detect", "replace", "reform", "transfer", "resume")
    print("\nwhere kill -> both training went (medians, seconds)")
    print("| size | replacement | tree | " + " | ".join(phases) + " |")
    print("|---|---|---|" + "---|" * len(phases))
    for size, spares, name in sorted(results, key=lambda k: (k[0], k[1], k[2] != "old")):
        runs = results[(size, spares, name)]
        cells = [f"{statistics.median(r.get(ph, 0.0) for r in runs):.3f}" for ph in phases]
        kind = "warm spare" if spares else "cold"
        print(f"| {size} MB | {kind} | {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
