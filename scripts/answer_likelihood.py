"""Graded retrieval of frozen checkpoints: teacher-forced answer log-likelihood on S-NIAH-1.

For checkpoints that never produce the exact answer, exact-match accuracy is 0 everywhere and
says nothing; ``answer_logprob`` (``qedprobe.eval.likelihood``: log p of `` {value}`` after the
prompt, summed over its tokens) still moves. Chance for the 7 random digits is
``7 ln(1/10) = -16.12`` nats (plus the leading space, ~0 for a trained model).

    python scripts/answer_likelihood.py --models checkpoints/recall-{gdn2,full}-s0 --lengths 1K,2K \\
        --samples 40 --strengths=-1,0,1,2 --out runs/likelihood.json

Every model sees the same prompts (task seed ``--seed``; sample i at length L is one prompt).
``--strengths`` apply to the QED arms (gdn2 runs at s = 1 only). Models are named by ``--labels``
(default: their folder names). Prints, per model, length and s, the mean (nats) with a 95% normal
interval, and paired comparisons on shared samples: each model against ``--baseline`` (default:
the first gdn2 model) at s = 1, and each s against s = 1 (mean difference, 95% interval, and the
exact sign test: ``mcnemar_exact`` on the counts of positive and negative differences). Writes
every per-sample value to ``--out`` (JSON), resuming from it.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from qedprobe.eval.likelihood import answer_logprob
from qedprobe.eval.stats import mcnemar_exact
from qedprobe.eval.spec import parse_float_list, parse_int_list
from qedprobe.tasks import make_task
from qedprobe.lam import check_strengths
from qedprobe.model import QEDModel, strength
from qedprobe.tokenizer import load_tokenizer


def mean_ci(xs):
    """Mean and its 95% normal-approximation interval."""
    n = len(xs)
    m = sum(xs) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    h = 1.96 * sd / math.sqrt(n)
    return m, m - h, m + h


def paired(a, b):
    """Mean of a - b with its interval and the exact sign-test p-value."""
    diff = [x - y for x, y in zip(a, b)]
    m, lo, hi = mean_ci(diff)
    return m, lo, hi, mcnemar_exact(sum(d > 0 for d in diff), sum(d < 0 for d in diff))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", required=True, help="checkpoint folders")
    ap.add_argument("--labels", default=None, help="comma list, one per model (default: folder names)")
    ap.add_argument("--baseline", default=None, help="label of the paired baseline (default: first gdn2 model)")
    ap.add_argument("--lengths", default="1K,2K")
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--strengths", default="1", help="comma list of s for the QED arms")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    lengths = parse_int_list(a.lengths, "--lengths")
    strengths = parse_float_list(a.strengths, "--strengths")
    check_strengths(strengths, arm="full")
    if a.samples < 2:
        raise SystemExit(f"--samples must be >= 2, got {a.samples}")
    out = Path(a.out)
    done = json.loads(out.read_text()) if out.is_file() else {}
    labels = a.labels.split(",") if a.labels else [Path(m).name for m in a.models]
    if len(labels) != len(a.models) or len(set(labels)) != len(labels):
        raise SystemExit(f"--labels: need {len(a.models)} distinct names, got {labels}")
    task = make_task("s-niah-1", load_tokenizer("bytes"), format="legacy")  # the checkpoints' format
    arms = {}
    for path, name in zip(a.models, labels):
        model = QEDModel.from_pretrained(path).float().eval()
        arms[name] = model.cfg.arm
        for L in lengths:
            prompts = task.samples(L, a.samples, seed=a.seed)
            for s in (strengths if model.cfg.arm != "gdn2" else [1.0]):
                key = f"{name}|{L}|{s:g}"
                if key not in done:
                    with strength(model, s):
                        done[key] = [answer_logprob(model, x) for x in prompts]
                    out.write_text(json.dumps(done))
                m, lo, hi = mean_ci(done[key])
                print(f"{key:28s} {m:8.3f} [{lo:.3f}, {hi:.3f}] nats ({m / 7:.3f} per digit)", flush=True)
    base = a.baseline or next((n for n in labels if arms[n] == "gdn2"), None)
    print("\npaired on shared samples: mean difference [95% interval], sign-test p")
    for name in labels:
        for L in lengths:
            ref = done[f"{name}|{L}|1"]
            for s in strengths:
                if s != 1 and f"{name}|{L}|{s:g}" in done:
                    print(f"{name:20s} L={L:<6d} s={s:<4g} vs s=1: %+.3f [%+.3f, %+.3f] p=%.3g"
                          % paired(done[f"{name}|{L}|{s:g}"], ref))
            if base and name != base:
                print(f"{name:20s} L={L:<6d} vs {base}: %+.3f [%+.3f, %+.3f] p=%.3g" % paired(ref, done[f"{base}|{L}|1"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
