"""Evaluation: NIAH tasks, strength sweeps with paired statistics, reports, eigenvalue histograms.

    from qedprobe.eval import make_task, run_sweep, build_report, run_eig, task_batches
"""
from .eig import EigAccumulator, run_eig, sigma_max_rank_one, task_batches, text_batches
from .report import build_report, paired_between
from .stats import clopper_pearson_interval, mcnemar_exact, wilson_interval
from .sweep import SweepError, load_results, plot_summary, run_sweep, summarize, write_summary
from .ruler import RULER_TASKS, RulerTask
from .tasks import (FORMATS, TASKS, NIAHTask, Sample, answer_fraction, make_task, score, string_match_all,
                    string_match_part, task_names)

__all__ = [
    "FORMATS", "TASKS", "RULER_TASKS", "NIAHTask", "RulerTask", "Sample", "make_task", "task_names", "score",
    "answer_fraction", "string_match_all", "string_match_part",
    "run_sweep", "load_results", "summarize", "write_summary", "plot_summary", "SweepError",
    "build_report", "paired_between",
    "EigAccumulator", "run_eig", "sigma_max_rank_one", "task_batches", "text_batches",
    "wilson_interval", "clopper_pearson_interval", "mcnemar_exact",
]
