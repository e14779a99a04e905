"""Does a model retrieve the *asked* key? Legacy-format MK-NIAH on real prompts vs the foreign-key control.

    python scripts/key_retrieval.py MODEL_OR_RUN_FOLDER [...] --tokenizer TOK --lengths 512 \
        --needles 2,4 --haystacks noise,prose --samples 40 --out runs/key-eval

Each MODEL is a model folder (``config.json`` + ``model.safetensors``) or a training run folder,
whose ``step-NNNNNN`` checkpoints are all evaluated (a learning curve). For every (model, needles,
haystack, length) cell it runs :func:`qedprobe.eval.sweep.run_sweep` at ``s = 1`` twice: on
``mk-niah`` and on its foreign-key control (:class:`qedprobe.tasks.control.ForeignKeyTask`,
same prompts asking a key no needle has), and prints one row: on the real prompts and on the
control, the exact accuracy and the share of answers that start writing the asked needle's value
(the needle sharing the longest prefix with the answer; robust to a model that copies digits
imperfectly), with the chance level ``1 / needles``. Key matching shows as real >> chance >= control. Results go
to ``OUT/<model>/<task>-n<needles>-<haystack>[-control]/`` (resumable sweep folders); the table
is also written to ``OUT/key_retrieval.md``.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from qedprobe.tasks.control import ForeignKeyTask
from qedprobe.eval import SweepSpec, load_results, run_sweep
from qedprobe.eval.spec import parse_int_list
from qedprobe.tasks import NIAHTask
from qedprobe.model import QEDModel

STEP_DIR = re.compile(r"step-(\d+)$")


def model_folders(paths) -> list[Path]:
    """Model folders, in order: each path itself, or its ``step-NNNNNN`` children sorted by step."""
    found = []
    for p in map(Path, paths):
        if (p / "config.json").is_file():
            found.append(p)
            continue
        steps = sorted((d for d in p.glob("step-*") if STEP_DIR.search(d.name)),
                       key=lambda d: int(STEP_DIR.search(d.name).group(1)))
        if not steps:
            raise SystemExit(f"key_retrieval: {p} is neither a model folder nor a run folder with step-* checkpoints")
        found += steps
    return found


def first_pick(prediction: str, needles) -> int | None:
    """Index of the needle whose value the prediction starts writing: the one sharing the longest
    prefix with the prediction's digits, None when no needle's first digit is written or two tie."""
    digits = "".join(ch for ch in prediction if not ch.isspace())
    shared = [next((i for i, (a, b) in enumerate(zip(digits, v)) if a != b), min(len(digits), len(v)))
              for _, v, _ in needles]
    best = max(shared)
    return shared.index(best) if best > 0 and shared.count(best) == 1 else None


def cell(model, folder: Path, tok, args, needles: int, haystack: str, control: bool) -> dict:
    """One sweep at s = 1 over ``args.lengths``; returns ``{length: (exact accuracy, picked)}``,
    ``picked`` the share of prompts whose answer starts writing the asked needle's value
    (:func:`first_pick`; chance 1 / needles for a model that copies some needle at random)."""
    kind = ForeignKeyTask if control else NIAHTask
    task = kind("mk-niah", tok, num_needles=needles, haystack=haystack)
    name = f"mk-niah-n{needles}-{haystack}" + ("-control" if control else "")
    out = Path(args.out) / f"{folder.parent.name}-{folder.name}" / name
    spec = SweepSpec(task=task, lengths=args.lengths, strengths=[1.0], samples=args.samples, seed=args.seed,
                     batch_size=args.batch_size, model_id=str(folder.resolve()), progress=False, decode="answer")
    result = run_sweep(model, spec, out=out)
    picked = {}
    for r in load_results(out):
        sample = task.sample(r["length"], r["sample_id"], samples=args.samples, seed=args.seed)
        picked.setdefault(r["length"], []).append(first_pick(r["prediction"], sample.needles) == 0)
    return {r["length"]: (r["accuracy"], sum(picked[r["length"]]) / len(picked[r["length"]]))
            for r in result.summary}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="model folders or training run folders (all step-* checkpoints)")
    ap.add_argument("--tokenizer", default=None, help="default: each model folder's own, else 'bytes'")
    ap.add_argument("--lengths", default="512", help="comma list of token lengths")
    ap.add_argument("--needles", default="2,4", help="comma list of needle counts")
    ap.add_argument("--haystacks", default="noise,prose", help="comma list of noise / prose")
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0, help="evaluation data seed (>= 0: disjoint from training)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the models run")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    args.lengths = parse_int_list(args.lengths, "--lengths")
    needles = parse_int_list(args.needles, "--needles")
    haystacks = [h.strip() for h in args.haystacks.split(",")]
    torch.set_num_threads(args.threads)
    lines = ["| model | needles | haystack | length | chance | real: exact / starts the asked value | "
             "foreign-key control: exact / starts the asked value |", "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for folder in model_folders(args.models):
        tok = args.tokenizer or (str(folder) if (folder / "tokenizer.json").is_file() else "bytes")
        model = QEDModel.from_pretrained(folder, dtype=torch.float32, device=args.device).eval()
        for n in needles:
            for hay in haystacks:
                real = cell(model, folder, tok, args, n, hay, False)
                ctrl = cell(model, folder, tok, args, n, hay, True)
                for length in args.lengths:
                    line = (f"| {folder.parent.name}/{folder.name} | {n} | {hay} | {length} | {1 / n:.2f} | "
                            f"{real[length][0]:.2f} / {real[length][1]:.2f} | "
                            f"{ctrl[length][0]:.2f} / {ctrl[length][1]:.2f} |")
                    lines.append(line)
                    print(line, flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "key_retrieval.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
