"""Put a strength sweep's table into a model's card (``MODEL_CARD.md``, section "Strength table").

    python scripts/card_strength.py MODEL_DIR SWEEP_DIR --command "qedprobe sweep ..."

SWEEP_DIR is a ``qedprobe sweep`` output folder of that model; the section holds the command
that made it and the sweep's summary (accuracy, Wilson 95 % interval, exact McNemar against
s = 1 with the discordant counts b / c), the table and legend ``qedprobe sweep`` prints. Running it again
replaces the section.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from qedprobe.cli.evaluation_run import summary_table
from qedprobe.train.card import set_card_section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--command", required=True, help="the qedprobe sweep command that wrote SWEEP_DIR")
    args = parser.parse_args()
    summary = json.loads((args.sweep_dir / "summary.json").read_text())
    rows = summary["rows"]
    body = (f"```bash\n{args.command}\n```\n\nTask {rows[0]['task']}, {rows[0]['format']} format.\n\n"
            f"{summary_table(rows)}")
    print(set_card_section(args.model_dir, "Strength table", body))


if __name__ == "__main__":
    main()
