"""``MODEL_CARD.md`` for an exported checkpoint: what was trained, on what, for how long."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

CARD_NAME = "MODEL_CARD.md"


def git_commit() -> str:
    """``git rev-parse HEAD`` of the qedprobe checkout (``"unknown"`` outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


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

A small QED language model trained with `qedprobe train` (byte-level, NIAH retrieval mixture).
Frozen for analysis: load with `QEDModel.from_pretrained(path)`. Weights are bf16
(`model.safetensors`); the float32 master weights and optimizer state stay in the run folder.

## Run

| | |
|---|---|
{rows}

## Data recipe

Documents are evaluation-format NIAH prompts from `qedprobe.eval.tasks` followed by their
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
