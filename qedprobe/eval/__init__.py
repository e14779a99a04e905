"""Evaluation, one way through: spec -> runner -> results store -> summary -> report and plots.

    from qedprobe.eval import SweepSpec, run_sweep, build_report, run_eig, task_batches

The tasks themselves are :mod:`qedprobe.tasks` (shared with training).
"""
from .eig import EigAccumulator, run_eig, sigma_max_rank_one, task_batches, text_batches
from .plots import plot_summary
from .report import build_report, paired_between
from .spec import SweepSpec, sweep_config
from .stats import clopper_pearson_interval, mcnemar_exact, wilson_interval
from .store import ResultsStore, SweepError, load_results, open_store
from .summary import summarize, summarize_folder, write_summary
from .sweep import SweepResult, run_sweep

__all__ = [
    "SweepSpec", "run_sweep", "SweepResult", "sweep_config", "SweepError",
    "ResultsStore", "open_store", "load_results", "summarize", "summarize_folder", "write_summary", "plot_summary",
    "build_report", "paired_between",
    "EigAccumulator", "run_eig", "sigma_max_rank_one", "task_batches", "text_batches",
    "wilson_interval", "clopper_pearson_interval", "mcnemar_exact",
]
