"""Profile (not a test): where one sweep batch spends its time on the GPU, in one device call.

Builds the random 340M-shape model of ``bench/sweep.py`` (bf16, CUDA), one batch of S-NIAH-1
prompts at ``--length`` (``--batch-tokens // length`` prompts, as the sweep packs them), and
times, each phase between CUDA synchronisations, on the plain path and then on the compiled fast
path (``qedprobe.model.fast_path``; ``fast_``-prefixed keys): one prefill pass (the first one
too, which compiles), the decode graph's capture, ``--steps`` decode steps replayed from the
graph and ``--steps`` eager decode steps. Then it runs one prefill and ``--steps`` graph decode
steps of the fast path (the plain path with ``--eager``) under ``torch.profiler`` and prints the
top ops by CUDA time for each, so the prefill's time can be attributed (kernel, matmuls, fused
regions, casts) and the decode step's GPU time compared with its wall time. One JSON line with
the phase times ends the output.

    python3 bench/profile_sweep.py                          # 1K prompts, as many as the sweep packs, 10 steps
    python3 bench/profile_sweep.py --length 32768 --steps 4
    python3 bench/profile_sweep.py --tiny --device cpu --length 512 --batch-tokens 2048 --steps 2  # smoke
    python3 bench/profile_sweep.py --inductor-option combo_kernels=true   # an inductor option on top of ours

A GPU machine without a package index: docs/BENCHMARKS.md, "Running on a rented GPU machine".
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from qedprobe.eval.plan import memory_batch_tokens
from qedprobe.tasks import NIAHTask
from qedprobe.model import QEDConfig, QEDModel, fast_path, strength
from qedprobe.model.decode_step import decode_step
from qedprobe.model.fast import COMPILE_OPTIONS
from qedprobe.model.packing import pack_prompts
from qedprobe.tokenizer import ByteTokenizer


def _timer(device):
    def timed(fn):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out, time.perf_counter() - t
    return timed


def inductor_options(items: list[str]) -> dict:
    """``NAME=VALUE`` strings -> ``{NAME: value}`` for ``torch.compile(options=...)``: the value as
    JSON (``true``, ``8``, ``"x"``) or else as the string; NAME must be an inductor config key."""
    import torch._inductor.config as inductor_config
    out = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not hasattr(inductor_config, name):
            raise ValueError(f"--inductor-option: {item!r} must be NAME=VALUE with NAME an inductor config key")
        try:
            out[name] = json.loads(raw)
        except json.JSONDecodeError:
            out[name] = raw
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--batch-tokens", type=int, default=None,
                    help="prompt tokens of the batch (default: the sweep's rule on CUDA, from the free memory; 2^18 on CPU)")
    ap.add_argument("--steps", type=int, default=10, help="decode steps per timed / profiled phase")
    ap.add_argument("--strength", type=float, default=1.5)
    ap.add_argument("--top", type=int, default=25, help="ops listed per profile")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 64 (CPU smoke run)")
    ap.add_argument("--trace", default=None, help="write the prefill's Chrome trace here")
    ap.add_argument("--eager", action="store_true", help="time and profile the plain path only")
    ap.add_argument("--inductor-option", action="append", default=[], metavar="NAME=VALUE",
                    help="an inductor option for the fast path's regions, on top of qedprobe's (e.g. "
                         "combo_kernels=true); repeatable")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.length < 1:
        ap.error("--steps and --length must be >= 1")
    try:
        COMPILE_OPTIONS.update(inductor_options(args.inductor_option))
    except ValueError as err:
        ap.error(str(err))

    device = torch.device(args.device)
    cfg = (QEDConfig(vocab_size=ByteTokenizer.vocab_size, hidden_size=64, num_hidden_layers=2, num_heads=2,
                     head_dim=16) if args.tiny else QEDConfig())
    torch.manual_seed(0)
    model = QEDModel(cfg).to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    task = NIAHTask("s-niah-1", "bytes")
    if args.batch_tokens is None:
        args.batch_tokens = memory_batch_tokens(model) if device.type == "cuda" else 2 ** 18
    n = max(1, args.batch_tokens // args.length)
    samples = task.samples(args.length, n)
    timed = _timer(device)
    wall = {}
    packed, wall["pack_s"] = timed(lambda: pack_prompts([s.input_ids for s in samples], cfg.vocab_size, device))

    def prefill():
        return model.run_blocks(packed.ids, states=None, cu_seqlens=packed.cu_seqlens,
                                scales=model.lam_scales("prefill"), want_state=True,
                                logit_positions=packed.last_positions)

    def steps(step, tokens):
        for _ in range(args.steps):
            tokens = step(tokens).argmax(-1)
        return tokens

    cuda_times = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda_times else [])
    sort = "self_cuda_time_total" if cuda_times else "self_cpu_time_total"

    def phases(prefix):
        """Time the phases of one path (module doc); returns the prefill's states and first tokens."""
        _, wall[prefix + "prefill_first_s"] = timed(prefill)  # includes Triton / inductor compilation
        (logits, states), wall[prefix + "prefill_s"] = timed(prefill)
        first = logits[0].argmax(-1)
        graph, wall[prefix + "graph_capture_s"] = timed(lambda: decode_step(model, states, scales))
        _, t = timed(lambda: steps(graph, first))
        wall[prefix + "graph_step_ms"] = 1e3 * t / args.steps
        _, t = timed(lambda: steps(decode_step(model, states, scales, cuda_graph=False), first))
        wall[prefix + "eager_step_ms"] = 1e3 * t / args.steps
        return states, first

    with torch.inference_mode(), strength(model, args.strength):
        scales = model.lam_scales("decode")
        states, first = phases("")
        path = contextlib.nullcontext() if args.eager else fast_path(model)
        with path:
            if not args.eager:
                states, first = phases("fast_")
            for name, fn in (("prefill", prefill),
                             ("decode", lambda: steps(decode_step(model, states, scales), first))):
                with profile(activities=activities) as prof:
                    timed(fn)
                print(f"\n=== {'plain' if args.eager else 'fast'} path, {name}: top {args.top} ops by {sort} ===")
                print(prof.key_averages().table(sort_by=sort, row_limit=args.top, max_name_column_width=60))
                if name == "prefill" and args.trace:
                    prof.export_chrome_trace(args.trace)
    res = {"device": torch.cuda.get_device_name(device) if cuda_times else "cpu", "torch": torch.__version__,
           "layers": cfg.num_hidden_layers, "length": args.length, "prompts": n,
           "prompt_tokens": sum(packed.lengths), "steps": args.steps, "inductor_options": COMPILE_OPTIONS,
           "prefill_tokens_per_s": round(sum(packed.lengths) / wall["prefill_s"], 1),
           **({} if args.eager else {"fast_prefill_tokens_per_s": round(sum(packed.lengths) / wall["fast_prefill_s"], 1)}),
           **{k: round(v, 4) for k, v in wall.items()}}
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
