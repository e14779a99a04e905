"""Benchmark (not a test): the Table-4 sweep grid on a randomly initialised model.

Default: the paper's 340M shape (24 layers, hidden 1024, 6 heads x 128, vocab 32000), bf16 on
CUDA, S-NIAH-1 in the legacy task format (the one docs/BENCHMARKS.md measured) with the byte
tokenizer (ids < 259 fit the 32000 vocabulary; lengths are then in
bytes), strengths -1,0,0.5,1,1.5,2, lengths 1K..32K, 500 samples: 18,000 rows, about 194M prompt
tokens. Target: <= 10 minutes on one H200.

    python bench/sweep.py                                  # the full grid (GPU)
    python bench/sweep.py --samples 50 --lengths 1K,32K    # a quick look
    python bench/sweep.py --tiny --device cpu --samples 2 --lengths 512 --strengths 0,1   # smoke

It prints one JSON object: wall time, rows, prompt / generated tokens, prompt tokens per second,
and where the time goes: prompt generation (CPU), prefill passes (timed around the packed
``QEDModel.run_blocks`` calls with a CUDA synchronisation, so the split costs a little), the rest
of the generate calls (decode steps, CUDA-graph capture, token readback), writing rows, summary +
plots. ``--decode answer`` (default here) decodes what the longest answer of a batch needs
(11 tokens for S-NIAH-1 in bytes), ``--decode budget`` the task's 16 (the sweep CLI's default).
A random model never emits EOS, so every prompt decodes all of them (the worst case).
``bench/profile_sweep.py`` attributes prefill and decode time per op.

On N GPUs: ``torchrun --standalone --nproc_per_node=N bench/sweep.py ...`` (every rank builds the
same seeded model on its GPU and runs its share of the batches; rank 0 prints the JSON, whose
``wall_s`` ends when the last rank is done and whose token counts are summed over the ranks;
the time split is rank 0's).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch

from qedprobe import dist
from qedprobe.eval.sweep import parse_float_list, parse_int_list, run_sweep
from qedprobe.model import QEDConfig, QEDModel
from qedprobe.tokenizer import ByteTokenizer


FULL_GRID_ROWS = 6 * 6 * 500
"""The Table-4 grid: six strengths x 1K..32K x 500 samples."""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1K,2K,4K,8K,16K,32K")
    ap.add_argument("--strengths", default="-1,0,0.5,1,1.5,2")
    ap.add_argument("--samples", type=int, default=500)
    ap.add_argument("--task", default="s-niah-1")
    ap.add_argument("--arm", default="full")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--batch-tokens", type=int, default=2 ** 18, help="prompt tokens per generate call")
    ap.add_argument("--batch-size", type=int, default=None, help="overrides --batch-tokens")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--decode", default="answer", choices=("budget", "answer"),
                    help="tokens decoded per prompt: the task budget or what the answers need")
    ap.add_argument("--eager", action="store_true", help="eager decode steps (default: CUDA-graph replay)")
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 64 (CPU smoke run)")
    ap.add_argument("--no-phase-timing", action="store_true", help="do not time prefill vs decode")
    ap.add_argument("--out", default=None, help="sweep folder (default: a temporary one, removed)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)

    lengths = parse_int_list(args.lengths, "--lengths")
    strengths = parse_float_list(args.strengths, "--strengths")
    if args.tiny:
        cfg = QEDConfig(vocab_size=ByteTokenizer.vocab_size, hidden_size=64, num_hidden_layers=2,
                        num_heads=2, head_dim=16, arm=args.arm)
    else:
        cfg = QEDConfig(arm=args.arm)  # the paper's 340M layout
    dist.init_from_env(args.device)
    device = dist.rank_device(args.device)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = QEDModel(cfg).to(device=device, dtype=getattr(torch, args.dtype)).eval()
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())

    phase = defaultdict(float)
    calls = defaultdict(int)
    if not args.no_phase_timing:
        inner = model.run_blocks

        def timed(*a, **k):
            if k.get("cu_seqlens") is None:  # a decode step (eager, or a graph's warm-up and capture)
                return inner(*a, **k)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            out = inner(*a, **k)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            phase["prefill_s"] += time.perf_counter() - t
            calls["prefill"] += 1
            return out

        model.run_blocks = timed
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    tmp = None
    out = args.out
    if out is None and dist.is_main():
        tmp = tempfile.TemporaryDirectory(prefix="qedprobe_bench_")
        out = os.path.join(tmp.name, "sweep")
    out = dist.gather_objects(out)[0]  # rank 0's folder, shared by every rank
    t0 = time.perf_counter()
    result = run_sweep(model, "bytes", task=args.task, task_format="legacy",
                       lengths=lengths, strengths=strengths,
                       samples=args.samples, seed=0, out=out, batch_size=args.batch_size,
                       batch_tokens=args.batch_tokens, max_new_tokens=args.max_new_tokens,
                       model_id=f"random-init {'tiny' if args.tiny else '340M'} {args.arm}",
                       progress=not args.no_progress, decode=args.decode,
                       cuda_graph=not args.eager)
    wall = time.perf_counter() - t0
    t = result.timing
    tokens = {k: sum(r[k] for r in dist.gather_objects(t)) for k in ("prompt_tokens", "new_tokens")}
    dist.barrier()  # every rank has read the folder before rank 0 removes it
    if not dist.is_main():
        return 0
    rows = len(lengths) * len(strengths) * args.samples
    full_grid = not args.tiny and rows == FULL_GRID_ROWS and lengths == parse_int_list("1K,2K,4K,8K,16K,32K")
    res = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "params": n_params,
        "config": {k: v for k, v in cfg.to_dict().items()
                   if k in ("hidden_size", "num_hidden_layers", "num_heads", "head_dim", "vocab_size", "arm")},
        "dtype": args.dtype,
        "ranks": dist.world_size(),
        "grid": {"task": args.task, "lengths": lengths, "strengths": strengths, "samples": args.samples,
                 "batch_tokens": args.batch_tokens, "batch_size": args.batch_size, "decode": args.decode},
        "rows": rows,
        "model_build_s": round(build_s, 2),
        "wall_s": round(wall, 2),
        "prompt_tokens": tokens["prompt_tokens"],
        "new_tokens": tokens["new_tokens"],
        "prompt_tokens_per_s": round(tokens["prompt_tokens"] / wall, 1) if wall else None,
        "time_s": {
            "prompt_generation": round(t.get("generate_prompts_s", 0), 2),
            "model_generate_calls": round(t.get("model_s", 0), 2),
            "prefill_passes": round(phase.get("prefill_s", 0), 2) if phase else None,
            "decode_and_rest_of_generate": round(t.get("model_s", 0) - phase.get("prefill_s", 0), 2)
            if phase else None,
            "write_rows": round(t.get("write_s", 0), 2),
            "summary_and_plots": round(t.get("summary_s", 0), 2),
        },
        "passes": dict(calls),
        "peak_gpu_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2)
        if device.type == "cuda" else None,
        # The 10-minute target is for the full Table-4 grid: judged only when this run is that grid.
        "target_met": wall <= 600 if full_grid else None,
        "full_grid_s_linear_estimate": None if args.tiny else round(wall * FULL_GRID_ROWS / rows, 1),
    }
    if phase:
        res["prefill_tokens_per_s"] = round(t.get("prompt_tokens", 0) / phase["prefill_s"], 1) \
            if phase.get("prefill_s") else None
    json.dump(res, sys.stdout, indent=2)
    print()
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
