"""Benchmark (not a test): the Table-4 sweep grid on a randomly initialised model.

Default: the paper's 340M shape (24 layers, hidden 1024, 6 heads x 128, vocab 32000), bf16 on
CUDA, S-NIAH-1 in the legacy task format with the byte tokenizer (ids < 259 fit the 32000
vocabulary; lengths are then in bytes), strengths -1,0,0.5,1,1.5,2, lengths 1K..32K, 500
samples: 18,000 rows, about 194M prompt tokens. Target: <= 10 minutes on one H200. The sweep
runs as ``qedprobe sweep`` does: on CUDA the compiled fast path (``qedprobe.model.fast_path``),
CUDA-graph decode steps, ``batch_tokens`` from the free GPU memory; ``--eager`` the plain path.

    python bench/sweep.py --out /tmp/sweep --budget 560 --json $OUT/sweep.json   # the full grid (GPU)
    python bench/sweep.py --samples 50 --lengths 1K,32K    # a quick look
    python bench/sweep.py --tiny --device cpu --samples 2 --lengths 512 --strengths 0,1   # smoke

Resuming: with ``--out`` the grid goes into that sweep folder, and ``--budget SECONDS`` starts
no batch that would end past the budget (the sweep's ``time_limit``). A second call with the
same arguments resumes the rows and the timing: ``OUT/bench_timing.json`` sums every call's wall
time, time per part, tokens and decode steps, so ``wall_s`` of the complete grid is the sum over
the calls (model build and summary included). Rows a killed call wrote without its timing are
counted as ``untimed_rows`` (its wall time is then missing from the sum).

It prints (and with ``--json``, or ``$OUT`` set, writes ``sweep.json``) one JSON object: ``rows``
(in the folder), ``full_grid`` (the complete 18,000-row Table-4 grid of the 340M shape),
``wall_s``, ``prefill_tokens_per_s`` (prompt tokens over the time of the packed prefill passes,
each timed between CUDA synchronisations, so the split costs a little; also per length),
``decode_ms_per_step`` (each decode step timed by CUDA events around it, no synchronisation;
also per batch size), ``time_s`` and ``share`` per part (prompt generation on the CPU, prefill
passes, decode steps, decode-graph capture, the rest of the generate calls, writing rows, summary
+ plots, the rest: model build, planning, compiles outside the prefill), ``device``, ``date``,
``commit``. ``--decode answer`` (default here) decodes what the longest answer of a batch needs
(11 tokens for S-NIAH-1 in bytes), ``--decode budget`` the task's 16. A random model never emits
EOS, so every prompt decodes all of them (the worst case). ``bench/profile_sweep.py`` attributes
prefill and decode time per op.

On N GPUs: ``torchrun --standalone --nproc_per_node=N bench/sweep.py ...`` (every rank builds the
same seeded model and runs its share of the batches; rank 0 reports, with token counts summed
over the ranks and the time split of rank 0).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from qedprobe import dist
from qedprobe.eval import SweepSpec, load_results, run_sweep
from qedprobe.eval.plan import memory_batch_tokens
from qedprobe.eval.spec import parse_float_list, parse_int_list
from qedprobe.model import QEDConfig, QEDModel
from qedprobe.model import generate as generation
from qedprobe.tokenizer import ByteTokenizer

# The Table-4 grid: six strengths x 1K..32K x 500 samples (18,000 rows; 193.5M nominal prompt tokens).
FULL_LENGTHS = parse_int_list("1K,2K,4K,8K,16K,32K")
FULL_STRENGTHS = [-1.0, 0.0, 0.5, 1.0, 1.5, 2.0]
FULL_SAMPLES = 500
FULL_GRID_TOKENS = sum(FULL_LENGTHS) * len(FULL_STRENGTHS) * FULL_SAMPLES

TIMING_FILE = "bench_timing.json"
SUMMARY_MARGIN_S = 15
"""Seconds of a call's ``--budget`` kept for the summary, plots and report after the last batch."""


class Meter:
    """Times the parts of the generate calls: prefill passes (between synchronisations) per
    prompt length, decode steps (CUDA events around each step, or host time on the CPU) per
    batch size, and the decode-graph capture; sums over one call."""

    def __init__(self, device, lengths):
        self.device, self.lengths = device, sorted(lengths)
        self.cuda = device.type == "cuda"
        self.prefill = defaultdict(lambda: [0, 0.0])   # length -> [tokens, seconds]
        self.decode = defaultdict(lambda: [0, 0.0])    # batch size -> [steps, seconds]
        self.events = []                               # (batch size, start, end) CUDA events
        self.capture_s = 0.0

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def wrap_prefill(self, model) -> None:
        inner = model.run_blocks

        def timed(*a, **k):
            cu = k.get("cu_seqlens")
            if cu is None:  # a decode step (eager, or a graph's warm-up and capture)
                return inner(*a, **k)
            self._sync()
            t = time.perf_counter()
            out = inner(*a, **k)
            self._sync()
            tokens, n = int(cu[-1]), cu.numel() - 1
            length = next((L for L in self.lengths if L >= tokens / n), self.lengths[-1])
            self.prefill[length][0] += tokens
            self.prefill[length][1] += time.perf_counter() - t
            return out
        model.run_blocks = timed

    def wrap_decode(self) -> None:
        """Time every step that ``generate`` takes from ``decode_step``."""
        inner, meter = generation.decode_step, self

        class Step:
            def __init__(self, step, n):
                self.step, self.n = step, n
                self.stop_check_every, self.stop_read_late = step.stop_check_every, step.stop_read_late

            def __call__(self, tokens):
                if not meter.cuda:
                    t = time.perf_counter()
                    out = self.step(tokens)
                    meter.decode[self.n][0] += 1
                    meter.decode[self.n][1] += time.perf_counter() - t
                    return out
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = self.step(tokens)
                end.record()
                meter.events.append((self.n, start, end))
                return out

        def decode_step(model, states, scales, **kw):
            self._sync()
            t = time.perf_counter()
            step = inner(model, states, scales, **kw)
            self._sync()
            self.capture_s += time.perf_counter() - t
            return Step(step, len(states[0].recurrent))
        generation.decode_step = decode_step

    def read_events(self) -> None:
        self._sync()
        for n, start, end in self.events:
            self.decode[n][0] += 1
            self.decode[n][1] += start.elapsed_time(end) / 1e3
        self.events.clear()

    def parts(self) -> dict:
        return {"prefill_s": sum(s for _, s in self.prefill.values()),
                "decode_steps_s": sum(s for _, s in self.decode.values()), "graph_capture_s": self.capture_s}


def add_into(total: dict, part: dict) -> dict:
    """``total`` with every number of ``part`` added in (nested dicts by key)."""
    out = dict(total)
    for k, v in part.items():
        out[k] = add_into(out.get(k, {}), v) if isinstance(v, dict) else out.get(k, 0) + v
    return out


def call_timing(meter: Meter, t, wall: float, build_s: float) -> dict:
    """One call's numbers, in the form :data:`TIMING_FILE` sums."""
    parts = meter.parts()
    rest_generate = t.get("model_s", 0) - sum(parts.values())
    time_s = {"prompt_generation": t.get("generate_prompts_s", 0), "prefill": parts["prefill_s"],
              "decode_steps": parts["decode_steps_s"], "graph_capture": parts["graph_capture_s"],
              "rest_of_generate": rest_generate, "write_rows": t.get("write_s", 0),
              "summary_and_plots": t.get("summary_s", 0)}
    time_s["other"] = wall - sum(time_s.values())
    return {"calls": 1, "wall_s": wall, "model_build_s": build_s, "time_s": time_s,
            "prompt_tokens": t.get("prompt_tokens", 0), "new_tokens": t.get("new_tokens", 0),
            "prefill_by_length": {str(L): {"tokens": n, "s": s} for L, (n, s) in meter.prefill.items()},
            "decode_by_batch": {str(N): {"steps": n, "s": s} for N, (n, s) in meter.decode.items()}}


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def report(total: dict, *, rows: int, grid_rows: int, full_grid: bool, full_grid_tokens: int | None,
           extra: dict) -> dict:
    """The JSON object of the whole grid so far (every call summed). Until the full Table-4 grid
    is measured, ``full_grid_s_estimate`` extrapolates the wall time to it by prompt tokens: the
    wall so far times ``full_grid_tokens`` (its nominal prompt tokens, the sum of length x
    strengths x samples; ``None`` for a model other than the 340M one) over the prompt tokens
    done. That scales an unfinished run and a run on fewer samples alike; prefill dominates and
    the long rows come last, so a share of rows would underestimate it. Rows done in untimed
    calls leave it ``None``."""
    wall, untimed = total["wall_s"], total["untimed_rows"]
    pre = total["prefill_by_length"]
    dec = total["decode_by_batch"]
    pre_tok, pre_s = sum(v["tokens"] for v in pre.values()), sum(v["s"] for v in pre.values())
    steps, dec_s = sum(v["steps"] for v in dec.values()), sum(v["s"] for v in dec.values())
    return {
        **extra,
        "rows": rows, "grid_rows": grid_rows, "full_grid": full_grid, "untimed_rows": untimed,
        "calls": total["calls"], "wall_s": round(wall, 2),
        "target_met": wall <= 600 if full_grid and not untimed else None,
        "prompt_tokens": total["prompt_tokens"], "new_tokens": total["new_tokens"],
        "prompt_tokens_per_s": round(total["prompt_tokens"] / wall, 1) if wall else None,
        "prefill_tokens_per_s": round(pre_tok / pre_s, 1) if pre_s else None,
        "prefill_tokens_per_s_by_length": {L: round(v["tokens"] / v["s"], 1) for L, v in
                                           sorted(pre.items(), key=lambda kv: int(kv[0])) if v["s"]},
        "decode_ms_per_step": round(1e3 * dec_s / steps, 3) if steps else None,
        "decode_ms_per_step_by_batch": {N: round(1e3 * v["s"] / v["steps"], 3) for N, v in
                                        sorted(dec.items(), key=lambda kv: int(kv[0])) if v["steps"]},
        "decode_steps": steps,
        "model_build_s": round(total["model_build_s"], 2),
        "time_s": {k: round(v, 2) for k, v in total["time_s"].items()},
        "share": {k: round(v / wall, 4) for k, v in total["time_s"].items()} if wall else None,
        "full_grid_s_estimate": (round(wall * full_grid_tokens / total["prompt_tokens"], 1)
                                 if full_grid_tokens and total["prompt_tokens"] and not full_grid and not untimed
                                 else None),
    }


def build_model(args, device):
    if args.tiny:
        cfg = QEDConfig(vocab_size=ByteTokenizer.vocab_size, hidden_size=64, num_hidden_layers=2,
                        num_heads=2, head_dim=16, arm=args.arm)
    else:
        cfg = QEDConfig(arm=args.arm)  # the paper's 340M layout
    torch.manual_seed(0)
    return QEDModel(cfg).to(device=device, dtype=getattr(torch, args.dtype)).eval()


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1K,2K,4K,8K,16K,32K")
    ap.add_argument("--strengths", default="-1,0,0.5,1,1.5,2")
    ap.add_argument("--samples", type=int, default=FULL_SAMPLES)
    ap.add_argument("--task", default="s-niah-1")
    ap.add_argument("--arm", default="full")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="prompt tokens per generate call (default: the sweep's rule, from the free GPU memory)")
    ap.add_argument("--batch-size", type=int, default=None, help="overrides --batch-tokens")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--decode", default="answer", choices=("budget", "answer"),
                    help="tokens decoded per prompt: the task budget or what the answers need")
    ap.add_argument("--eager", action="store_true", help="the plain path: plain PyTorch layers, eager decode steps")
    ap.add_argument("--eager-decode", action="store_true", help="eager decode steps (default: CUDA-graph replay)")
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 64 (CPU smoke run)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for this call: no batch starts that would end past it (resume with a second call)")
    ap.add_argument("--out", default=None, help="sweep folder, resumable (default: a temporary one, removed)")
    ap.add_argument("--json", default=None, help="write the report here (default: $OUT/sweep.json when $OUT is set)")
    ap.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse of this checkout)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.budget is not None and args.budget <= SUMMARY_MARGIN_S:
        ap.error(f"--budget must exceed {SUMMARY_MARGIN_S} s (kept for the summary)")
    return args


def main(argv=None) -> int:
    t_call = time.perf_counter()
    args = parse_args(argv)
    lengths = parse_int_list(args.lengths, "--lengths")
    strengths = parse_float_list(args.strengths, "--strengths")
    dist.init_from_env(args.device)
    device = dist.rank_device(args.device)
    model = build_model(args, device)
    build_s = time.perf_counter() - t_call
    if args.batch_tokens is None and args.batch_size is None and device.type == "cuda":
        args.batch_tokens = memory_batch_tokens(model)  # the sweep's own rule, recorded in the report
    meter = Meter(device, lengths)
    meter.wrap_prefill(model)
    meter.wrap_decode()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    tmp = None
    out = args.out
    if out is None and dist.is_main():
        tmp = tempfile.TemporaryDirectory(prefix="qedprobe_bench_")
        out = os.path.join(tmp.name, "sweep")
    out = dist.gather_objects(out)[0]  # rank 0's folder, shared by every rank
    timing_path = Path(out) / TIMING_FILE
    before = json.loads(timing_path.read_text()) if timing_path.exists() else None
    rows_before = len(load_results(out)) if Path(out, "results.jsonl").exists() else 0
    untimed = max(0, rows_before - (before["rows"] if before else 0))
    limit = None if args.budget is None else args.budget - (time.perf_counter() - t_call) - SUMMARY_MARGIN_S
    spec = SweepSpec(task=args.task, task_format="legacy", lengths=lengths, strengths=strengths,
                     samples=args.samples, seed=0, batch_size=args.batch_size,
                     batch_tokens=args.batch_tokens, max_new_tokens=args.max_new_tokens,
                     model_id=f"random-init {'tiny' if args.tiny else '340M'} {args.arm}",
                     progress=not args.no_progress, decode=args.decode,
                     cuda_graph=not (args.eager or args.eager_decode), fast_path=False if args.eager else None,
                     time_limit=None if limit is None else max(limit, 0.0))
    result = run_sweep(model, spec, out=out)
    meter.read_events()
    t = dict(result.timing)
    for k in ("prompt_tokens", "new_tokens"):
        t[k] = sum(r[k] for r in dist.gather_objects(result.timing))
    dist.barrier()  # every rank has read the folder before rank 0 removes it
    if not dist.is_main():
        return 0
    rows = len(load_results(out)) if Path(out, "results.jsonl").exists() else 0
    grid_rows = len(lengths) * len(strengths) * args.samples
    full_grid = (not args.tiny and result.missing == 0 and lengths == FULL_LENGTHS and args.samples == FULL_SAMPLES
                 and sorted(strengths) == FULL_STRENGTHS and args.task == "s-niah-1")
    peak = round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2) if device.type == "cuda" else None
    before = before or {}
    total = add_into({k: v for k, v in before.items() if k not in ("rows", "peak_gpu_mem_gib")},
                     {**call_timing(meter, t, time.perf_counter() - t_call, build_s), "untimed_rows": untimed})
    peaks = [p for p in (peak, before.get("peak_gpu_mem_gib")) if p is not None]
    peak = max(peaks) if peaks else None
    timing_path.write_text(json.dumps({**total, "rows": rows, "peak_gpu_mem_gib": peak}, indent=1) + "\n")
    cfg = model.cfg
    extra = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "commit": args.commit or git_commit(), "torch": torch.__version__,
        "params": sum(p.numel() for p in model.parameters()),
        "config": {k: v for k, v in cfg.to_dict().items()
                   if k in ("hidden_size", "num_hidden_layers", "num_heads", "head_dim", "vocab_size", "arm")},
        "dtype": args.dtype, "ranks": dist.world_size(),
        "path": f"fast ({result.fast_path})" if result.fast_path else "plain",
        "cuda_graph": not (args.eager or args.eager_decode),
        "grid": {"task": args.task, "lengths": lengths, "strengths": strengths, "samples": args.samples,
                 "batch_tokens": args.batch_tokens, "batch_size": args.batch_size, "decode": args.decode},
        "peak_gpu_mem_gib": peak,
    }
    res = report(total, rows=rows, grid_rows=grid_rows, full_grid=full_grid,
                 full_grid_tokens=None if args.tiny else FULL_GRID_TOKENS, extra=extra)
    json.dump(res, sys.stdout, indent=2)
    print()
    target = args.json or (os.path.join(os.environ["OUT"], "sweep.json") if os.environ.get("OUT") else None)
    if target:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_text(json.dumps(res, indent=2) + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
