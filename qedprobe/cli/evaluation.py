"""Sub-commands ``sweep``, ``report`` and ``eig`` of the ``qedprobe`` CLI: their parsers.

``register(subparsers)`` adds them; each runs ``run_x_cmd(args) -> int`` of
:mod:`qedprobe.cli.evaluation_run`, imported only then (:func:`qedprobe.cliutil.runs`): this
module imports no torch, so ``--help`` and usage errors are instant.
"""
from __future__ import annotations

import argparse

from qedprobe.cliutil import COMMAND_HELP, PROGRESS_HELP, runs
from qedprobe.constants import ARMS
from qedprobe.eval.arguments import SweepError, parse_int_list
from qedprobe.tasks import DEFAULT_FORMAT, FORMATS

__all__ = ["register", "add_threads_flag", "parse_length"]

DTYPES = ("auto", "float32", "bfloat16", "float16")
EXTRAPOLATION_HELP = ("allow s outside [-1, 2] and --qed-lambda outside [0, 0.25] (lambda_max of a QED head): "
                      "beyond them the state may grow")


def _common_model_args(p):
    p.add_argument("--model", required=True,
                   help="folder written by QEDModel.save_pretrained, or a transformers folder of a "
                        "delta-rule family (qedprobe.hf.SUPPORTED: Qwen3.5, Qwen3-Next, OLMo-Hybrid, "
                        "Qwen4-Exp, Lara-Mini, Kimi-Linear, Bailing-Hybrid, GLM-5-Next)")
    p.add_argument("--tokenizer", default=None,
                   help="'bytes' (built-in byte tokenizer) or a local Hugging Face tokenizer folder "
                        "(default: the --model folder when it is a transformers folder or holds a "
                        "tokenizer.json, else bytes)")
    p.add_argument("--qed-lambda", type=float, default=None,
                   help="transformers --model only: inject QED with this lambda on every "
                        "linear-attention head (default: none, the model as trained)")
    p.add_argument("--qed-arm", default="full", choices=[a for a in ARMS if a != "gdn2"],
                   help="erase direction of --qed-lambda")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights dtype; auto (the default) is bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--layers", default=None, help="comma list of layers whose lambda s scales (default all)")
    p.add_argument("--heads", default=None, help="comma list of heads whose lambda s scales (default all)")
    p.add_argument("--format", default=DEFAULT_FORMAT, choices=FORMATS,
                   help="task format: ruler (NVIDIA RULER's NIAH prompts, budget and score; default) or "
                        "legacy (the format the shipped checkpoints were trained on)")
    add_threads_flag(p)
    p.add_argument("--chat-template", action="store_true",
                   help="ruler format: put each prompt in the tokenizer's own chat template as the user's "
                        "turn, the assistant's turn opened, then RULER's answer prefix (default: raw prompts)")


def add_threads_flag(p) -> None:
    """``--threads`` (applied by :func:`set_threads`), shared with ``qedprobe lm-eval``."""
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads, >= 1 (default: torch's, one per core; with another torch process on "
                        "the same cores, 1 avoids their contention)")


def register(subparsers) -> None:
    """Add ``sweep``, ``report`` and ``eig`` to an argparse ``subparsers`` object."""
    _register_sweep(subparsers)
    _register_report(subparsers)
    _register_eig(subparsers)


def _register_sweep(subparsers) -> None:
    p = subparsers.add_parser("sweep", help=COMMAND_HELP["sweep"],
                              description="Run a strength sweep: every (length, s, sample) once, "
                                          "appended to OUT/results.jsonl; rerun to resume.")
    _common_model_args(p)
    p.add_argument("--task", default="s-niah-1",
                   help="ruler: niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue, niah_multiquery "
                        "(s-niah-1/2/3 and mk-niah name niah_single_1/2/3 and niah_multikey_1); "
                        "legacy: s-niah-1, s-niah-2, s-niah-3 or mk-niah")
    p.add_argument("--lengths", default="1024,2048,4096", help="comma list of token lengths (2K = 2048)")
    p.add_argument("--strengths", default="-1,0,0.5,1,1.5,2", help="comma list of s (lambda -> s * lambda)")
    p.add_argument("--samples", type=int, default=500, help="prompts per length and strength")
    p.add_argument("--seed", type=int, default=0, help="data seed (keys, values, haystack offsets)")
    p.add_argument("--out", required=True, help="output folder (created; reused to resume)")
    p.add_argument("--batch-size", type=int, default=None, help="prompts per generate call")
    p.add_argument("--batch-tokens", type=int, default=None,
                   help="on CUDA without --batch-size: batch = batch_tokens // length (default: the largest "
                        "power of two <= 2^20 whose prefill fits in 60%% of the free GPU memory)")
    p.add_argument("--phase", default="all", choices=("all", "prefill", "decode"),
                   help="where s scales lambda: every token, the prompt only, or the generated tokens only")
    p.add_argument("--ref-strength", type=float, default=1.0, help="McNemar reference strength")
    p.add_argument("--haystack-file", default=None,
                   help="essay/prose haystack: ruler's essay tasks take RULER's PaulGrahamEssays.json, a "
                        ".txt file or a folder of them; legacy s-niah-2/3, mk-niah a text file "
                        "(default: the shipped prose, a stand-in for the essays)")
    p.add_argument("--num-needles", type=int, default=None, help="legacy: needles in mk-niah (default 4)")
    p.add_argument("--haystack", default=None, choices=("noise", "prose"),
                   help="legacy: haystack of mk-niah (default prose; the other tasks have a fixed one)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="legacy only: tokens generated per prompt, >= 1 (default: 16 for numbers, 48 for "
                        "UUIDs; ruler: 128)")
    p.add_argument("--control", default=None, choices=("foreign-key",),
                   help="legacy mk-niah only: ask a key that no needle has, scoring the asked needle's value "
                        "(qedprobe.tasks.control; a key-matching model falls to <= 1/num_needles)")
    p.add_argument("--allow-extrapolation", action="store_true", help=EXTRAPOLATION_HELP)
    p.add_argument("--eager", action="store_true",
                   help="the plain path for debugging: every layer in plain PyTorch (not the torch.compile'd "
                        "fast path a QEDModel runs on CUDA by default) and eager decode steps (as --eager-decode)")
    p.add_argument("--eager-decode", action="store_true",
                   help="decode step by step in eager mode instead of replaying a CUDA graph (same rows)")
    p.add_argument("--no-progress", action="store_true", help=PROGRESS_HELP)
    runs(p, "qedprobe.cli.evaluation_run:run_sweep_cmd")


def _register_report(subparsers) -> None:
    p = subparsers.add_parser("report", help=COMMAND_HELP["report"],
                              description="Markdown tables and a figure from sweep folders.")
    p.add_argument("sweeps", nargs="+", help="sweep output folders")
    p.add_argument("--labels", default=None, help="comma list of column labels (default: folder names)")
    p.add_argument("--s", type=float, default=1.0, help="strength shown in the main table")
    p.add_argument("--baseline", default="0", help="index or label of the baseline sweep (default first)")
    p.add_argument("--title", default=None, help="report title")
    p.add_argument("--out", default=None, help="folder for report.md, report.json, report.png")
    runs(p, "qedprobe.cli.evaluation_run:run_report_cmd")


def _register_eig(subparsers) -> None:
    p = subparsers.add_parser("eig", help=COMMAND_HELP["eig"],
                              description="Run a task or a text file through the model and save "
                                          "per-layer, per-head statistics of the erase factor.")
    _common_model_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--task", default=None, help="NIAH task providing the inputs (default s-niah-1)")
    src.add_argument("--text", default=None, help="text file providing the inputs")
    p.add_argument("--length", type=parse_length, default=4096, help="tokens per input (2K = 2048)")
    p.add_argument("--samples", type=int, default=8, help="number of inputs")
    p.add_argument("--seed", type=int, default=0, help="data seed of the task inputs")
    p.add_argument("--batch-size", type=int, default=1, help="inputs per forward pass")
    p.add_argument("--strength", type=float, default=1.0, help="s for lambda -> s * lambda")
    p.add_argument("--allow-extrapolation", action="store_true", help=EXTRAPOLATION_HELP)
    p.add_argument("--out", required=True, help="folder for eig.npz, eig.json and figures")
    p.add_argument("--no-progress", action="store_true", help=PROGRESS_HELP)
    runs(p, "qedprobe.cli.evaluation_run:run_eig_cmd")


def parse_length(text):
    try:
        (v,) = parse_int_list(text, "length")
    except (SweepError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return v
