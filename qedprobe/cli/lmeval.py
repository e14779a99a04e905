"""Sub-command ``lm-eval`` of the ``qedprobe`` CLI: its parser. It runs
:func:`qedprobe.cli.lmeval_run.run_lmeval_cmd`, imported only then (lm-eval, torch).
"""
from __future__ import annotations

from qedprobe.cliutil import COMMAND_HELP, PROGRESS_HELP, runs

from .evaluation import add_threads_flag

__all__ = ["register", "PROTOCOL"]

PROTOCOL = "niah_single_1,niah_single_2,niah_single_3,fda,swde,squad_completion"
"""The QED paper's Table 3 / Table 4 tasks as lm-eval names them (RULER's S-NIAH, the Based recall suite)."""


def register(subparsers) -> None:
    """Add ``lm-eval`` to an argparse ``subparsers`` object."""
    p = subparsers.add_parser(
        "lm-eval", help=COMMAND_HELP["lm-eval"],
        description="Run lm-eval tasks with the qedprobe model once per strength: every (task, s, document) "
                    "once, appended to OUT/results.jsonl with its response; rerun to resume. Needs lm-eval "
                    "(pip install -e \".[lmeval]\").")
    p.add_argument("--model-args", required=True,
                   help="the qedprobe model's arguments, lm-eval style: pretrained=DIR (a QEDModel folder or a "
                        "transformers folder qedprobe.hf supports), and optionally tokenizer, phase, layers "
                        "(0;2), heads, qed_lambda, qed_arm, dtype, device, batch_size, max_length, "
                        "allow_extrapolation, eager; the strength comes from --strengths")
    p.add_argument("--tasks", default=PROTOCOL, help="comma list of lm-eval tasks or groups")
    p.add_argument("--strengths", default="-1,0,0.5,1,1.5,2", help="comma list of s (lambda -> s * lambda)")
    p.add_argument("--ref-strength", type=float, default=1.0, help="McNemar reference strength")
    p.add_argument("--out", required=True, help="output folder (created; reused to resume)")
    p.add_argument("--limit", type=int, default=None,
                   help="documents per task (per task and length for RULER's tasks): the first N, the same "
                        "for every strength (default: all)")
    p.add_argument("--include-path", default=None, help="a folder of task yamls added to lm-eval's tasks")
    p.add_argument("--metadata", default=None,
                   help="JSON passed to the tasks as lm-eval's --metadata, e.g. '{\"max_seq_lengths\": "
                        "[1024, 2048, 4096]}' for RULER's lengths (the model args are passed too)")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    p.add_argument("--metric", default=None,
                   help="the per-document metric that decides right/wrong (default: RULER's per-length score, "
                        "contains, else the task's first metric)")
    p.add_argument("--device", default=None, help="as the model argument device (cuda, cuda:1, cpu; default: cuda "
                                                   "if available; under torchrun cuda:LOCAL_RANK)")
    p.add_argument("--dtype", default=None, help="as the model argument dtype (default auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--batch-size", type=int, default=None, help="as the model argument batch_size (default 1)")
    add_threads_flag(p)
    p.add_argument("--no-progress", action="store_true", help=PROGRESS_HELP)
    runs(p, "qedprobe.cli.lmeval_run:run_lmeval_cmd")
