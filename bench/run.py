"""Run a registered benchmark (``bench/registry.py``) and record the machine it ran on.

    python bench/run.py --list
    python bench/run.py kernels --out runs/bench -- --quick --dplr
    python bench/run.py sweep -- --tiny --device cpu --samples 2 --lengths 512 --strengths 0,1

Everything after ``--`` goes to the benchmark's own command line (``python bench/NAME.py --help``).
With ``--out DIR`` the benchmark writes its files there (``$OUT``) and the runner adds
``DIR/NAME.machine.json``: date (UTC), host, GPU, and the torch / triton / fla versions, the
facts each table of ``docs/BENCHMARKS.md`` states. Each script also runs alone, as
``python bench/<script> ARGS``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import runpy
import sys
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from registry import BENCHMARKS, Benchmark, get_benchmark  # noqa: E402


def machine_info() -> dict:
    """Date, host, GPU and library versions of this process's machine."""
    import torch
    info = {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "cuda": torch.version.cuda}
    for dist in ("torch", "triton", "fla-core", "qedprobe"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    return info


def run_benchmark(bench: Benchmark, args: list[str], out: str | None = None) -> int:
    """Run ``bench``'s script as ``__main__`` with ``args``; its exit status (0 when it returns)."""
    if out is not None:
        os.makedirs(out, exist_ok=True)
        os.environ["OUT"] = out
        info = {"benchmark": bench.name, "command": [f"bench/{bench.script}", *args], **machine_info()}
        Path(out, f"{bench.name}.machine.json").write_text(json.dumps(info, indent=1) + "\n")
    argv = sys.argv
    sys.argv = [str(bench.path), *args]
    try:
        runpy.run_path(str(bench.path), run_name="__main__")
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sys.argv = argv
    return 0


def print_list() -> None:
    for bench in BENCHMARKS.values():
        print(f"{bench.name:18s} bench/{bench.script:22s} [{bench.device}]\n    {bench.measures}"
              + (f"\n    writes: {', '.join(bench.writes)}" if bench.writes else ""))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", nargs="?", choices=sorted(BENCHMARKS), help="the benchmark to run")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    ap.add_argument("--out", default=None, help="folder for the benchmark's files and machine.json ($OUT)")
    a = ap.parse_args(own)
    if a.list:
        print_list()
        return 0
    if a.name is None:
        ap.error("give a benchmark NAME (--list shows them)")
    return run_benchmark(get_benchmark(a.name), rest, a.out)


if __name__ == "__main__":
    sys.exit(main())
