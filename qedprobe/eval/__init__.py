"""Evaluation, one way through: spec -> runner -> results store -> summary -> report and plots.

    from qedprobe.eval import SweepSpec, run_sweep, build_report, run_eig, task_batches

The tasks themselves are :mod:`qedprobe.tasks` (shared with training). The names are imported
from their modules on first use (:mod:`qedprobe.lazy`): the command line's parsers read
:mod:`qedprobe.eval.arguments` without loading torch.
"""
from qedprobe.lazy import lazy_exports

__all__ = [
    "SweepSpec", "run_sweep", "SweepResult", "sweep_config", "SweepError",
    "ResultsStore", "open_store", "load_results", "summarize", "summarize_folder", "write_summary", "plot_summary",
    "build_report", "paired_between",
    "EigAccumulator", "run_eig", "sigma_max_rank_one", "task_batches", "text_batches",
    "wilson_interval", "clopper_pearson_interval", "mcnemar_exact",
]

__getattr__ = lazy_exports(__name__, {
    **dict.fromkeys(("EigAccumulator", "run_eig", "sigma_max_rank_one", "task_batches", "text_batches"), "eig"),
    "plot_summary": "plots", "build_report": "report", "paired_between": "report",
    "SweepSpec": "spec", "sweep_config": "spec", "SweepError": "arguments",
    **dict.fromkeys(("clopper_pearson_interval", "mcnemar_exact", "wilson_interval"), "stats"),
    **dict.fromkeys(("ResultsStore", "load_results", "open_store"), "store"),
    **dict.fromkeys(("summarize", "summarize_folder", "write_summary"), "summary"),
    "SweepResult": "sweep", "run_sweep": "sweep"})
