r"""qedprobe.hf on a GPU: equality with transformers at T = 4096 through the Triton path, and
prefill speed against the model's own fla / PyTorch recurrence.

For each family (random weights built by transformers from a config of realistic width: hidden
1024, 16 q/k heads and 32 value heads of 128 for the linear attention, 6 linear + 2 softmax
layers; nothing is downloaded):

* **equality** (float32 weights, B = 1, T = ``--length``): the adapted model (``qed_chunk``
  Triton prefill, ``qed_recurrent`` decode) against the unadapted model on transformers' own
  PyTorch recurrence, and the model's default path (fla's kernels when fla is installed)
  against the same reference, for the logits of a forward and of 16 greedy ``generate`` steps.
  Pass: the adapted model is as close to the PyTorch path as fla is
  (``max|adapted - torch| <= 2 max|fla - torch| + 1e-5 max|torch|``), and its greedy tokens agree
  with the PyTorch path's wherever fla's do.
* **prefill speed** (bfloat16 weights, B = ``--batch``, T = ``--length``): a full forward
  (``use_cache=False``) of the adapted model without and with the probes (a hook on
  ``hook_e`` of every layer), of the model's default path (fla) and of the PyTorch path; median
  of ``--repeat`` timed calls after a warm-up, CUDA events.

Writes ``OUT/hf_check.json`` and ``OUT/hf_check.md`` (the table for docs/BENCHMARKS.md).
``--small`` runs a tiny shape on any device (the CPU dry run of this script).

    python scripts/hf_check.py --families qwen3_5,olmo_hybrid --length 4096 --batch 4 --out OUT
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid")
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]


def config(family: str, small: bool):
    """A transformers config of ``family``: the realistic width, or (``small``) a tiny one."""
    from transformers import OlmoHybridConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig
    if small:
        width = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=16)
        head_dim, v_dim = 16, 16
    else:
        width = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_attention_heads=8,
                     num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=32,
                     linear_key_head_dim=128)
        head_dim, v_dim = 128, 128
    common = dict(width, num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES)
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=width["intermediate_size"] // 4,
               shared_expert_intermediate_size=width["intermediate_size"] // 4)
    return {
        "qwen3_5": lambda: Qwen3_5TextConfig(**common, head_dim=head_dim, linear_value_head_dim=v_dim),
        "qwen3_5_moe": lambda: Qwen3_5MoeTextConfig(**common, **moe, head_dim=head_dim, linear_value_head_dim=v_dim),
        "qwen3_next": lambda: Qwen3NextConfig(**common, **moe, head_dim=head_dim, linear_value_head_dim=v_dim),
        "olmo_hybrid": lambda: OlmoHybridConfig(**common, linear_value_head_dim=2 * v_dim, pad_token_id=0,
                                                eos_token_id=None),
    }[family]()


def build(family: str, small: bool, dtype, device):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config(family, small)).to(device=device, dtype=dtype).eval()


def torch_path(model):
    from qedprobe.hf import transformers_torch_path
    return transformers_torch_path(model.config.model_type)


def timed(fn, repeat: int, device) -> float:
    """Median milliseconds of ``repeat`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def run_paths(model, ids, new_tokens: int, fla: bool) -> dict:
    """Forward logits and greedy ``generate`` (tokens, per-step logits) of the unadapted model
    on transformers' PyTorch recurrence (``torch``) and on its default path (``fla``)."""
    out = {}
    paths = [("torch", torch_path(model))] + ([("fla", contextlib.nullcontext())] if fla else [])
    for name, ctx in paths:
        with torch.no_grad(), ctx:
            logits = model(ids, use_cache=False).logits.float()
            gen = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        out[name] = (logits, gen.sequences[:, ids.shape[1]:], [s.float() for s in gen.logits])
    return out


def equality(family: str, args, device) -> dict:
    from qedprobe.hf import adapt
    model = build(family, args.small, torch.float32, device)
    ids = torch.randint(2, model.config.get_text_config().vocab_size, (1, args.length),
                        generator=torch.Generator().manual_seed(1)).to(device)
    ref = run_paths(model, ids, args.new_tokens, fla=args.fla)
    adapted = adapt(model)
    with torch.no_grad():
        logits = adapted(ids).float()
        gen = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    ours = (logits, gen.sequences[:, ids.shape[1]:], [s.float() for s in gen.logits])
    torch_logits, torch_tokens, torch_steps = ref["torch"]
    scale = float(torch_logits.abs().max())

    def diffs(other):
        logits_o, tokens_o, steps_o = other
        return {"forward_max_abs": float((logits_o - torch_logits).abs().max()),
                "decode_max_abs": max(float((a - b).abs().max()) for a, b in zip(steps_o, torch_steps)),
                "tokens_equal": int((tokens_o == torch_tokens).sum()), "tokens": int(torch_tokens.numel())}

    row = {"family": family, "T": args.length, "logit_scale": scale, "ours": diffs(ours)}
    if args.fla:
        row["fla"] = diffs(ref["fla"])
        bound = lambda k: 2 * row["fla"][k] + 1e-5 * scale  # noqa: E731
        row["pass"] = (row["ours"]["forward_max_abs"] <= bound("forward_max_abs")
                       and row["ours"]["decode_max_abs"] <= bound("decode_max_abs")
                       and row["ours"]["tokens_equal"] >= row["fla"]["tokens_equal"])
    adapted.detach()
    return row


def speed(family: str, args, device) -> dict:
    from qedprobe.hf import adapt
    model = build(family, args.small, torch.bfloat16, device)
    ids = torch.randint(2, model.config.get_text_config().vocab_size, (args.batch, args.length),
                        generator=torch.Generator().manual_seed(2)).to(device)

    def forward():
        with torch.no_grad():
            model(ids, use_cache=False)

    row = {"family": family, "B": args.batch, "T": args.length}
    with torch_path(model):
        row["torch_ms"] = timed(forward, args.repeat, device)
    if args.fla:
        row["fla_ms"] = timed(forward, args.repeat, device)
    adapted = adapt(model)
    row["ours_ms"] = timed(forward, args.repeat, device)
    with adapted.hooks(fwd_hooks=[(lambda n: n.endswith("linear_attn.hook_e"), lambda e, hook: None)]):
        row["ours_probes_ms"] = timed(forward, args.repeat, device)
    row["tokens_per_s_ours"] = args.batch * args.length / row["ours_ms"] * 1e3
    adapted.detach()
    return row


def markdown(report: dict) -> str:
    lines = [f"Device: {report['device']}; torch {report['torch']}, transformers {report['transformers']}, "
             f"fla {report['fla']}; T = {report['length']}.", "",
             "| family | fwd max abs: ours vs torch | fla vs torch | decode max abs: ours | fla | "
             "greedy tokens = torch: ours | fla | max abs logit | pass |", "|---|---|---|---|---|---|---|---|---|"]
    def g(x):
        return "-" if x is None else f"{x:.3g}"
    for r in report["equality"]:
        fla = r.get("fla", {})
        lines.append(f"| {r['family']} | {g(r['ours']['forward_max_abs'])} | {g(fla.get('forward_max_abs'))} | "
                     f"{g(r['ours']['decode_max_abs'])} | {g(fla.get('decode_max_abs'))} | "
                     f"{r['ours']['tokens_equal']}/{r['ours']['tokens']} | {fla.get('tokens_equal', '-')} | "
                     f"{g(r['logit_scale'])} | {r.get('pass', '-')} |")
    lines += ["", "| family | B | T | ours ms | ours + probes ms | fla ms | torch ms | ours tokens/s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in report["speed"]:
        lines.append(f"| {r['family']} | {r['B']} | {r['T']} | {r['ours_ms']:.1f} | {r['ours_probes_ms']:.1f} | "
                     f"{r.get('fla_ms', float('nan')):.1f} | {r['torch_ms']:.1f} | {r['tokens_per_s_ours']:,.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default="qwen3_5,olmo_hybrid", help=f"comma list of {FAMILIES}")
    p.add_argument("--length", type=int, default=4096, help="prompt tokens")
    p.add_argument("--batch", type=int, default=4, help="prompts per timed prefill")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens compared")
    p.add_argument("--repeat", type=int, default=5, help="timed calls per path")
    p.add_argument("--small", action="store_true", help="a tiny shape (CPU dry run)")
    p.add_argument("--no-fla", dest="fla", action="store_false", help="skip the model's default (fla) path")
    p.add_argument("--out", required=True, help="folder for hf_check.json / .md")
    args = p.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    bad = [f for f in families if f not in FAMILIES]
    if bad:
        p.error(f"--families: unknown {bad}; choose from {FAMILIES}")
    import transformers
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        import fla
        fla_version = fla.__version__
    except ImportError:
        fla_version, args.fla = None, False
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "fla": fla_version,
              "length": args.length, "equality": [], "speed": []}
    os.makedirs(args.out, exist_ok=True)
    for family in families:
        report["equality"].append(equality(family, args, device))
        print(json.dumps(report["equality"][-1]), flush=True)
        report["speed"].append(speed(family, args, device))
        print(json.dumps(report["speed"][-1]), flush=True)
        with open(os.path.join(args.out, "hf_check.json"), "w") as fh:  # after every family: a cut run keeps its rows
            json.dump(report, fh, indent=1)
        with open(os.path.join(args.out, "hf_check.md"), "w") as fh:
            fh.write(markdown(report))
    print(markdown(report))
    return 0 if all(r.get("pass", True) for r in report["equality"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
