r"""Check qedprobe's token mixer against fla's ``GatedDeltaNet2`` layer with the same weights.

Run on a CUDA machine from the repository root (qedprobe installed, e.g. ``pip install -e .
--no-deps``)::

    pip install --no-deps fla_core-0.6.0-py3-none-any.whl flash_linear_attention-0.6.0-py3-none-any.whl einops
    python scripts/fla_layer_check.py --out fla_layer_check.json

``transformers``, ``transformer-lens`` and ``safetensors`` are not needed: when missing,
``fla.layers`` is imported without its package ``__init__`` (which pulls in transformers) and
``qedprobe.model.mixer`` is imported without the ``__init__`` of ``qedprobe`` and
``qedprobe.model`` (which pull in transformer-lens and safetensors); the mixer's hook points then
come from a stand-in identity module (no hook is used here).

For every case fla's layer is built with random weights, its ``state_dict`` is loaded into our
``QEDMixer`` unchanged (``strict=True``; QED arms also get ``theta``), and both run the same
input in inference mode (fla picks ``fused_recurrent`` for T <= 64 and ``chunk`` above):

* ``gdn2``: our arm gdn2 must equal fla.
* ``full@s=0``: our full QED arm with lambda multiplied by 0 (``strength(model, 0)``'s effect on
  the mixer) must equal fla.
* ``full``: the same model at its own strength must *differ* from fla in float32 (so the check
  can fail); in bfloat16 the difference is only reported.
* ``varlen``: packed sequences through ``cu_seqlens`` on both sides.
* ``decode``: our prefill of the first T0 tokens then one recurrent step per token, carrying the
  recurrent and convolution state, against fla's full-sequence output.

Each case runs with ``op_mode="auto"`` (qedprobe's Triton kernels) and ``"naive"`` (the PyTorch
reference on the GPU). Exit status 1 if any check fails.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import types
from pathlib import Path

import torch
from torch import nn


def _bare_package(name: str) -> None:
    """Register package ``name`` with its search path but without running its ``__init__``."""
    spec = importlib.util.find_spec(name)
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations)
    sys.modules[name] = module


def import_fla_layer():
    try:
        from fla.layers.gdn2 import GatedDeltaNet2
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] == "fla":
            raise
        sys.modules.pop("fla.layers", None)
        _bare_package("fla.layers")
        GatedDeltaNet2 = importlib.import_module("fla.layers.gdn2").GatedDeltaNet2
    return GatedDeltaNet2


def import_qed_mixer():
    """``QEDConfig`` and ``QEDMixer``; without transformer-lens, import them without running
    ``qedprobe/__init__`` and ``qedprobe/model/__init__`` and with a stand-in ``HookPoint``."""
    try:
        import transformer_lens.hook_points  # noqa: F401
    except ModuleNotFoundError:
        class HookPoint(nn.Module):
            """Stand-in identity hook point (no hooks in this check)."""

            name = None

            def forward(self, x):
                return x

            def has_hooks(self, *args, **kwargs):
                return False

        for name in ("transformer_lens", "transformer_lens.hook_points"):
            sys.modules[name] = types.ModuleType(name)
        sys.modules["transformer_lens.hook_points"].HookPoint = HookPoint
        _bare_package("qedprobe")
        _bare_package("qedprobe.model")
    from qedprobe.model.config import QEDConfig
    from qedprobe.model.mixer import QEDMixer
    return QEDConfig, QEDMixer


def compare(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = (ours.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    return {"max_abs": diff, "rel": diff / max(scale, 1e-30), "ref_max": scale}


def run_case(GatedDeltaNet2, QEDConfig, QEDMixer, *, arm, lam_zero, T, dtype, op_mode, varlen, decode, seed,
             H=4, K=64, D=256, device="cuda"):
    torch.manual_seed(seed)
    fla = GatedDeltaNet2(hidden_size=D, head_dim=K, num_heads=H, mode="chunk", layer_idx=0).to(device).eval()
    with torch.no_grad():  # larger than init so the recurrence matters
        for p in fla.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    cfg = QEDConfig(vocab_size=8, hidden_size=D, num_hidden_layers=1, num_heads=H, head_dim=K, arm=arm,
                    norm_eps=fla.o_norm.eps, op_mode=op_mode)
    ours = QEDMixer(cfg, 0).to(device).eval()
    extra = {"theta": torch.linspace(-1, 2, H, device=device)} if arm != "gdn2" else {}
    ours.load_state_dict({**fla.state_dict(), **extra}, strict=True)
    fla, ours = fla.to(dtype), ours.to(dtype)
    scale = torch.zeros(H, device=device) if lam_zero else None
    B = 1 if varlen else 2
    x = torch.randn(B, T, D, device=device, dtype=dtype)
    with torch.inference_mode():
        if varlen:
            cu = torch.tensor([0, T // 3, T // 3 + 5, T], device=device, dtype=torch.int32)
            ref = fla(x, cu_seqlens=cu)[0]
            out = ours(x, lam_scale=scale, cu_seqlens=cu)[0]
        else:
            ref = fla(x)[0]
            if decode:
                t0 = T // 2
                pieces, state = [], None
                o, state = ours(x[:, :t0], lam_scale=scale, want_state=True)
                pieces.append(o)
                for t in range(t0, T):
                    o, state = ours(x[:, t:t + 1], lam_scale=scale, state=state, want_state=True)
                    pieces.append(o)
                out = torch.cat(pieces, 1)
            else:
                out = ours(x, lam_scale=scale)[0]
    return compare(out, ref)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fla_layer_check: needs CUDA")
        return 2
    GatedDeltaNet2 = import_fla_layer()
    QEDConfig, QEDMixer = import_qed_mixer()
    tol = {torch.float32: 2e-3, torch.bfloat16: 3e-2}  # relative to max |fla output|
    rows, failed = [], 0
    for dtype in (torch.float32, torch.bfloat16):
        for op_mode in ("auto", "naive"):
            for T in (17, 64, 300):
                cases = [("gdn2", "gdn2", False, False, False), ("full@s=0", "full", True, False, False),
                         ("full", "full", False, False, False), ("varlen", "gdn2", False, True, False),
                         ("varlen full@s=0", "full", True, True, False), ("decode", "gdn2", False, False, True),
                         ("decode full@s=0", "full", True, False, True)]
                for name, arm, lam_zero, varlen, decode in cases:
                    if decode and T == 300 and op_mode == "naive":
                        continue  # slow and covered by T=64
                    try:
                        res = run_case(GatedDeltaNet2, QEDConfig, QEDMixer, arm=arm, lam_zero=lam_zero, T=T,
                                       dtype=dtype, op_mode=op_mode, varlen=varlen, decode=decode, seed=T)
                        if name != "full":
                            ok = res["rel"] <= tol[dtype]
                        else:  # must differ; in bfloat16 only reported (rounding is of similar size)
                            ok = res["rel"] > 5 * tol[dtype] or dtype != torch.float32
                    except Exception as err:  # report and keep going
                        res, ok = {"error": f"{type(err).__name__}: {err}"}, False
                    failed += not ok
                    row = {"case": name, "T": T, "dtype": str(dtype).replace("torch.", ""), "op_mode": op_mode,
                           "ok": ok, **res}
                    rows.append(row)
                    detail = res.get("error") or f"max_abs={res['max_abs']:.3e} rel={res['rel']:.3e}"
                    print(f"{'PASS' if ok else 'FAIL'} {name:16s} T={T:4d} {row['dtype']:8s} {op_mode:5s} {detail}")
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "failed": failed,
               "checks": len(rows), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    print(f"{len(rows) - failed}/{len(rows)} checks passed on {summary['device']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
