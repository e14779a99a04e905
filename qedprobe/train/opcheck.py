"""Does the QED op the model will call have a working backward on the training device?

A fast op can fail in three ways that would otherwise surface mid-run or never: it returns an
output cut off from the graph (training would silently freeze q, k, v, b, w, g and theta), it
raises or faults (a Triton kernel that reads out of bounds at the training length poisons the
CUDA context, so nothing in the process can recover), or it gives wrong gradients.
:func:`backward_problem` runs the op once at the training length (one row) and dtype, compares
its gradients with the differentiable PyTorch op's, and says what is wrong, so the trainer can
stop with a clear message or fall back to the PyTorch reference. On CUDA the check runs in a
child process, so that a faulting kernel takes down the child, not the trainer.

    python -m qedprobe.train.opcheck --arm full --heads 2 --head-dim 128 --v-dim 128 \
        --device cuda --dtype bfloat16 --mode auto --tokens 2048
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from qedprobe.lam import random_directions
from qedprobe.ops import qed_attention

PROBE_TOKENS = 64
REFERENCE_MODE = "torch"
GRAD_TOLERANCE = {torch.float64: 1e-8, torch.float32: 2e-3, torch.bfloat16: 6e-2, torch.float16: 2e-2}
"""Largest accepted ``max |grad - grad_ref| / max |grad_ref|`` per input dtype."""
CHILD_SECONDS = 600


def backward_problem(model_cfg, device: torch.device, dtype: torch.dtype, mode: str,
                     tokens: int = PROBE_TOKENS) -> str | None:
    """None when ``qed_attention(mode=mode)`` gives finite gradients to ``q, k, v, g, b, w`` (and
    ``lam`` for arms other than ``gdn2``) on ``device`` that agree with the PyTorch op's within
    :data:`GRAD_TOLERANCE`; otherwise the reason, in words.

    Inputs are ``[1, tokens, H, K|V]`` in ``dtype`` (``g`` float32, as the model makes them).
    On CUDA the check runs in a child process (:func:`problem_in_child`).
    """
    shape = dict(arm=model_cfg.arm, heads=model_cfg.num_heads, head_dim=model_cfg.head_dim,
                 v_dim=model_cfg.head_v_dim)
    if device.type == "cuda":
        return problem_in_child(**shape, device=device, dtype=dtype, mode=mode, tokens=tokens)
    return op_problem(**shape, device=device, dtype=dtype, mode=mode, tokens=tokens)


def probe_inputs(arm: str, heads: int, head_dim: int, v_dim: int, device, dtype, tokens: int, seed: int = 0):
    """``(q, k, v, g, b, w, lam, z)``: leaves ``[1, tokens, H, K|V]`` as the model makes them
    (``g`` a float32 log-decay, ``b, w`` in (0, 1)), ``lam = 0.05`` per head, ``z`` for ``rand``."""
    gen = torch.Generator().manual_seed(seed)

    def leaf(n, dt=dtype, fn=lambda x: x):
        return fn(torch.randn(1, tokens, heads, n, generator=gen)).to(device, dt).requires_grad_()

    q, k, v = leaf(head_dim), leaf(head_dim), leaf(v_dim)
    g = leaf(head_dim, dt=torch.float32, fn=lambda x: -torch.nn.functional.softplus(x) * 0.1)
    b, w = leaf(head_dim, fn=torch.sigmoid), leaf(v_dim, fn=torch.sigmoid)
    lam = torch.full((heads,), 0.05, device=device, requires_grad=arm != "gdn2")
    z = random_directions(heads, head_dim, 0).to(device) if arm == "rand" else None
    return q, k, v, g, b, w, lam, z


def op_gradients(mode: str, arm: str, inputs) -> dict[str, torch.Tensor]:
    """Gradients of ``sum(o^2)`` (``o`` of ``qed_attention(mode=mode)``) w.r.t. the leaves that
    need one; raises ``ValueError`` when the output has no gradient graph."""
    q, k, v, g, b, w, lam, z = inputs
    leaves = {"q": q, "k": k, "v": v, "g": g, "b": b, "w": w}
    if lam.requires_grad:
        leaves["lam"] = lam
    o, _, _ = qed_attention(q, k, v, g, b, w, lam, mode=mode, arm=arm, z=z)
    if not o.requires_grad:
        raise ValueError("returns an output without a gradient graph")
    found = torch.autograd.grad(o.float().square().sum(), list(leaves.values()), allow_unused=True)
    return dict(zip(leaves, found))


def checked_op(mode: str, tokens: int, device) -> str:
    """How a problem report names the op it checked."""
    return f"qed_attention(mode={mode!r}) at {tokens} tokens on {device}"


def op_problem(arm: str, heads: int, head_dim: int, v_dim: int, device, dtype, mode: str, tokens: int) -> str | None:
    """The check of :func:`backward_problem`, in this process."""
    what = checked_op(mode, tokens, device)
    inputs = probe_inputs(arm, heads, head_dim, v_dim, device, dtype, tokens)
    try:
        got = op_gradients(mode, arm, inputs)
    except ValueError as err:
        return f"{what} {err}"
    except Exception as err:  # noqa: BLE001 - any failure means: no usable backward
        return f"{what} failed forward/backward: {type(err).__name__}: {err}"
    bad = [n for n, t in got.items() if t is None or not torch.isfinite(t).all()]
    if bad:
        return f"{what} gives no finite gradient to {bad}"
    if mode == REFERENCE_MODE:
        return None
    ref = op_gradients(REFERENCE_MODE, arm, inputs)
    bound = GRAD_TOLERANCE[dtype]
    errs = {n: ((got[n].double() - ref[n].double()).abs().max() / ref[n].double().abs().max().clamp_min(1e-30)).item()
            for n in got}
    wrong = {n: f"{e:.2g}" for n, e in errs.items() if not e <= bound}
    if wrong:
        return f"{what} gives gradients that differ from mode {REFERENCE_MODE!r} by {wrong} (relative; bound {bound:g})"
    return None


PACKAGE_ROOT = Path(__file__).resolve().parents[2]
"""The folder holding the imported ``qedprobe``: the child's working directory, so that ``-m`` finds the
same package as this process (not a source checkout that happens to be the current directory)."""


def child_command(arm: str, heads: int, head_dim: int, v_dim: int, device, dtype, mode: str, tokens: int) -> list[str]:
    """The command line that runs :func:`op_problem` in a fresh Python (this module's CLI)."""
    return [sys.executable, "-m", "qedprobe.train.opcheck", "--arm", arm, "--heads", str(heads),
            "--head-dim", str(head_dim), "--v-dim", str(v_dim), "--device", str(device),
            "--dtype", str(dtype).removeprefix("torch."), "--mode", mode, "--tokens", str(tokens)]


def problem_in_child(**check) -> str | None:
    """:func:`op_problem` in a child process: its answer, or what killed it (a fault, a timeout)."""
    cmd = child_command(**check)
    what = checked_op(check["mode"], check["tokens"], check["device"])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_SECONDS, cwd=PACKAGE_ROOT)
    except subprocess.TimeoutExpired:
        return f"{what}: the check did not finish in {CHILD_SECONDS} s"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        return f"{what} crashed the check's process (exit code {done.returncode}): {tail}"
    return json.loads(lines[-1])["problem"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--head-dim", type=int, required=True)
    ap.add_argument("--v-dim", type=int, required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--dtype", required=True, choices=[str(d).removeprefix("torch.") for d in GRAD_TOLERANCE])
    ap.add_argument("--mode", required=True)
    ap.add_argument("--tokens", type=int, default=PROBE_TOKENS)
    a = ap.parse_args(argv)
    problem = op_problem(a.arm, a.heads, a.head_dim, a.v_dim, torch.device(a.device), getattr(torch, a.dtype),
                         a.mode, a.tokens)
    print(json.dumps({"problem": problem}))


if __name__ == "__main__":
    main()
