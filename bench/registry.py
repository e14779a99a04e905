"""The benchmarks of qedprobe: one entry per script in ``bench/``, run by ``bench/run.py``.

A benchmark measures speed or resources of this tree's code and prints (and, when ``$OUT`` is
set, writes) its numbers; its table in ``docs/BENCHMARKS.md`` names the command, machine and date.
GPU entry points (training and evaluating checkpoints, the GPU tests) and the docs' table generators live in ``scripts/``.

To add a benchmark: put the script in ``bench/`` (runnable as ``python bench/NAME.py [ARGS]``,
reference timings measured in the same run rather than passed in) and add a :class:`Benchmark`
to :data:`BENCHMARKS`; ``tests/test_bench.py`` fails for a script that is not registered.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
SHARED_MODULES = ("registry.py", "run.py", "layer_inputs.py")
"""The files of ``bench/`` that are not benchmarks: this registry, its runner and the inputs the
benchmarks (and ``scripts/``'s launch screens) share."""


@dataclass(frozen=True)
class Benchmark:
    """How to run one benchmark and what it gives.

    Args:
        name: the runner's name for it (``python bench/run.py NAME``).
        script: its file in ``bench/``.
        measures: one line: what is timed or counted, against what.
        device: what it needs: ``"cuda"``, ``"cuda (cpu smoke: ARGS)"`` or ``"none"`` (no GPU).
        writes: the files it writes under ``$OUT`` (besides what it prints).
    """
    name: str
    script: str
    measures: str
    device: str
    writes: tuple[str, ...] = ()

    @property
    def path(self) -> Path:
        return BENCH_DIR / self.script


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("kernels", "kernel_times.py",
              "qed_chunk forward (fresh and after smaller shapes, every arm, probes off / on, T = 1K..32K, "
              "grouped heads), forward + backward and a decode step, against fla chunk_gdn2 / "
              "fused_recurrent_gdn2 (and chunk_dplr_delta_rule with --dplr) in the same run",
              "cuda", ("kernels.json",)),
    Benchmark("hf_models", "hf_models.py",
              "qed_chunk / qed_recurrent with the gates real models have (Gated DeltaNet's per-head g and "
              "beta, 16 / 32 / 64 value heads; KDA's per-channel g) against fla chunk_gated_delta_rule, "
              "chunk_kda and fused_recurrent_gated_delta_rule (FlashQLA where installed), time and peak "
              "memory, in the same run; the adapted decoder against the native one",
              "cuda", ("hf_models.json",)),
    Benchmark("recurrent_decode", "recurrent_decode.py",
              "qed_recurrent per decode step (do_bench, CUDA-graph replay, host time) against fla "
              "fused_recurrent_gdn2, and the launch-configuration sweep (--host-only: the host paths "
              "alone, on any machine)",
              "cuda", ("recurrent_decode.json",)),
    Benchmark("sweep", "sweep.py",
              "the Table-4 strength-sweep grid on a random 340M model (resumable over calls): wall time, "
              "prefill tokens per second, decode ms per step, the share of time per part",
              "cuda (cpu smoke: --tiny --device cpu)", ("sweep.json",)),
    Benchmark("profile_sweep", "profile_sweep.py",
              "one sweep batch phase by phase (pack, prefill, graph capture, graph / eager decode) and "
              "the top ops of each under torch.profiler", "cuda (cpu smoke: --tiny --device cpu)"),
    Benchmark("forward_traffic", "forward_traffic.py",
              "an analytic model (not a measurement) of the bytes each qed_chunk forward launch reads and "
              "writes, against fla chunk_gdn2's forward launches", "none"),
    Benchmark("cpu_generate", "cpu_generate.py",
              "one batched QEDModel.generate call on CPU (16 MK-NIAH prompts of 1K, interference-full-s0, "
              "the PyTorch chunk path) at THREADS threads", "none"),
    Benchmark("registers", "chunk_aot.py",
              "shared memory, registers and spills per chunk kernel, compiled for sm_90 by Triton's "
              "AOT path and its ptxas", "none"),
)}


def get_benchmark(name: str) -> Benchmark:
    """The registered benchmark ``name``; a ``ValueError`` lists the names when it is unknown."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; expected one of {sorted(BENCHMARKS)}")
    return BENCHMARKS[name]
