"""Compare what one GPU and N GPUs wrote (scripts/distributed_check.sh); prints one JSON line and
exits 1 when they disagree beyond the stated tolerance.

    python scripts/dist_compare.py rows  SWEEP_1 SWEEP_N     # same rows, same predictions
    python scripts/dist_compare.py eig   EIG_1 EIG_N         # histograms, counts, extremes equal; moments close
    python scripts/dist_compare.py train RUN_1 RUN_N         # per-step loss / grad_norm close; tokens/s of each
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from qedprobe.eval.store import load_results
from qedprobe.train import read_log

EXACT_EIG = ("hist_", "count_", "n_", "min_", "max_", "edges_", "layers")
TRAIN_RTOL = 2e-2
"""bf16 autocast: a row's logits depend on the batch it is in (kernel choice), so the first
steps' loss and gradient norm agree to bf16 precision, not to float32."""
WARM_STEPS = 5
"""Steps left out of tokens/s (compilation, autotuning, the first data batches)."""


def compare_rows(a, b) -> dict:
    ra = {(r["length"], r["s"], r["sample_id"]): r for r in load_results(a)}
    rb = {(r["length"], r["s"], r["sample_id"]): r for r in load_results(b)}
    differ = [k for k in ra.keys() & rb.keys() if ra[k]["prediction"] != rb[k]["prediction"]]
    return {"rows": [len(ra), len(rb)], "same_keys": ra.keys() == rb.keys(), "predictions_differ": len(differ),
            "ok": ra.keys() == rb.keys() and not differ}


def compare_eig(a, b) -> dict:
    za, zb = np.load(Path(a) / "eig.npz"), np.load(Path(b) / "eig.npz")
    exact = [n for n in za.files if n.startswith(EXACT_EIG) and not np.array_equal(za[n], zb[n])]
    close = [n for n in za.files if not n.startswith(EXACT_EIG)
             and not np.allclose(za[n], zb[n], rtol=1e-9, atol=1e-12, equal_nan=True)]
    return {"exact_differ": exact, "moments_differ": close, "ok": not exact and not close}


def _tokens_per_s(log) -> float | None:
    rest = [r for r in log if r["step"] > WARM_STEPS]
    if len(rest) < 2:
        return None
    return (rest[-1]["tokens"] - rest[0]["tokens"]) / sum(r["step_s"] for r in rest[1:])


def compare_train(a, b) -> dict:
    la, lb = read_log(a), read_log(b)
    rel = {k: max(abs(x[k] - y[k]) / max(abs(y[k]), 1e-12) for x, y in zip(la[:3], lb[:3]))
           for k in ("loss", "grad_norm")}
    return {"steps": [len(la), len(lb)], "max_rel_diff_first_3_steps": rel,
            "tokens_per_s": [_tokens_per_s(la), _tokens_per_s(lb)],
            "ok": len(la) == len(lb) and all(v <= TRAIN_RTOL for v in rel.values())}


def main(argv) -> int:
    kinds = {"rows": compare_rows, "eig": compare_eig, "train": compare_train}
    if len(argv) != 3 or argv[0] not in kinds:
        print(__doc__, file=sys.stderr)
        return 2
    res = {"compare": argv[0], "a": argv[1], "b": argv[2], **kinds[argv[0]](argv[1], argv[2])}
    print(json.dumps(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
