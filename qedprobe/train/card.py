"""Export a finished run: the bf16 model and its ``MODEL_CARD.md`` (what was trained, on what, for how long)."""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import torch

from .bpe import FILES

CARD_NAME = "MODEL_CARD.md"
FINAL_WINDOW = 20
"""The card's final loss is the mean over the last ``FINAL_WINDOW`` steps."""


def git_commit() -> str:
    """The qedprobe commit: ``git rev-parse HEAD`` of the checkout this module lives in, else
    ``$QEDPROBE_COMMIT`` (set by ``scripts/device_env.sh`` from the wheel's build record, since an
    installed wheel has no git), else ``"unknown"``."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("QEDPROBE_COMMIT") or "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"


def write_model_card(folder: Path, *, title: str, model_cfg: dict, train_cfg: dict, data: dict,
                     summary: dict) -> Path:
    """Write ``folder/MODEL_CARD.md``; ``summary`` holds the run's numbers (steps, tokens, losses,
    wall time, device, date, op mode, ...), printed as a table in the given order."""
    rows = "\n".join(f"| {k} | {v} |" for k, v in summary.items())
    text = f"""# {title}

A small QED language model trained with `qedprobe train` (NIAH retrieval mixture).
Frozen for analysis: load with `QEDModel.from_pretrained(path)`. Weights are bf16
(`model.safetensors`); the float32 master weights and optimizer state stay in the run folder.

## Run

| | |
|---|---|
{rows}

## Data recipe

Documents are evaluation-format NIAH prompts from `qedprobe.tasks` in the **legacy** task
format (`task_format` in `config.json`; evaluate with `qedprobe sweep --format legacy`; the default
`ruler` format is NVIDIA RULER's prompts, which this model has not seen) followed by their
answer and EOS, packed whole into rows (PAD after). Training draws its samples from negative
`NIAHTask.sample` seeds (`niah_seed` below); evaluation uses seeds >= 0, so the two never share
a seed stream. See `qedprobe/train/data.py`.

```json
{json.dumps(data, indent=2)}
```

## Model config (`config.json`)

```json
{json.dumps(model_cfg, indent=2, sort_keys=True)}
```

## Training config

```json
{json.dumps(train_cfg, indent=2, sort_keys=True)}
```
"""
    path = folder / CARD_NAME
    path.write_text(text)
    return path


def copy_tokenizer(tokenizer: str, folder: Path) -> None:
    """Copy a tokenizer folder's files (:data:`qedprobe.train.bpe.FILES`, those present) into
    ``folder``; nothing for ``"bytes"``."""
    if tokenizer == "bytes":
        return

    for name in FILES:
        src = Path(tokenizer) / name
        if src.is_file():
            shutil.copyfile(src, Path(folder) / name)


def export(model, cfg, data, out_dir: Path, export_dir: Path,
            records: list[dict], device: torch.device, op_used: str) -> float:
    """bf16 copy of the model + ``MODEL_CARD.md`` into ``export_dir``, with the tokenizer's files
    when it is a folder (so that evaluation reads it from the model folder); returns the final loss."""
    frozen = copy.deepcopy(model).to(torch.bfloat16)
    frozen.save_pretrained(export_dir)
    copy_tokenizer(cfg.tokenizer, export_dir)
    last = records[-FINAL_WINDOW:]
    final_loss = sum(r["loss"] for r in last) / len(last)
    weights = export_dir / "model.safetensors"
    summary = {
        "arm": cfg.arm, "seed": cfg.seed, "steps": records[-1]["step"],
        "tokens (rows x seq_len)": records[-1]["tokens"],
        f"final loss (nats/token, mean of last {len(last)} steps, loss={cfg.loss!r})": f"{final_loss:.4f}",
        "final answer loss / answer token accuracy (last step)":
            f"{records[-1]['answer_loss']:.4f} / {records[-1]['answer_acc']:.4f}",
        "final key-token accuracy (last step; chance about 1/needles)": f"{records[-1].get('key_acc', 0.0):.4f}",
        "final mean lambda": f"{records[-1]['lambda_mean']:.5f}",
        "tokenizer": "bytes" if cfg.tokenizer == "bytes" else "BPE (tokenizer.json in this folder)",
        "parameters": sum(p.numel() for p in model.parameters()),
        "weights file": f"{weights.stat().st_size / 2**20:.2f} MiB (bf16)",
        "wall time": f"{records[-1]['wall_s']:.1f} s",
        "device": device_name(device), "op used in training": f"{op_used} (qed_attention mode, on {device.type})",
        "date (UTC)": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "qedprobe commit": git_commit(), "torch": torch.__version__,
        "run folder": str(out_dir),
    }
    write_model_card(export_dir, title=f"qedprobe {cfg.arm} seed {cfg.seed}", model_cfg=frozen.cfg.to_dict(),
                     train_cfg=cfg.to_dict(), data=data.describe(), summary=summary)
    return final_loss
