"""The run's two logs: ``loss.jsonl`` (one JSON record per step) and ``train.log`` (events)."""
from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path

from tqdm.auto import tqdm

from qedprobe import dist

LOG_NAME = "loss.jsonl"
NOTES_NAME = "train.log"


def read_log(out_dir) -> list[dict]:
    """Records of ``out_dir/loss.jsonl`` (empty when there is none). A last line cut short by a
    kill mid-write is dropped; a broken line elsewhere is a ``ValueError``."""
    path = Path(out_dir) / LOG_NAME
    if not path.is_file():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i < len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON ({err})") from err
    return records


def truncate_log(out_dir: Path, step: int) -> int:
    """Keep only records of steps ``<= step`` (a crash after a checkpoint leaves later ones);
    returns how many records were dropped (the caller says so in ``train.log``)."""
    records = read_log(out_dir)
    kept = [r for r in records if r["step"] <= step]
    (Path(out_dir) / LOG_NAME).write_text("".join(json.dumps(r) + "\n" for r in kept))
    return len(records) - len(kept)


def note(out_dir: Path, message: str) -> None:
    """Append a time-stamped line to ``train.log`` and print it to stderr (above a progress bar;
    rank 0 only under torch.distributed: the ranks run in step, one account is enough)."""
    if not dist.is_main():
        return
    line = f"[{datetime.now(timezone.utc).isoformat(timespec='seconds')}] {message}"
    tqdm.write(line, file=sys.stderr)
    with open(Path(out_dir) / NOTES_NAME, "a") as fh:
        fh.write(line + "\n")
