"""CPU: time one ``QEDModel.generate`` call on 16 MK-NIAH prompts (8 needles, 1K tokens, 8 new tokens)
of ``checkpoints/interference-full-s0`` in float32, the batched path of the CPU evaluation.

    python bench/cpu_generate.py THREADS
"""
import sys
import time
from pathlib import Path

import torch

from qedprobe.tasks import NIAHTask
from qedprobe.model import QEDModel

CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints" / "interference-full-s0"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit() or int(argv[0]) < 1:
        raise SystemExit("usage: python bench/cpu_generate.py THREADS (a positive integer)")
    threads = int(argv[0])
    torch.set_num_threads(threads)
    model = QEDModel.from_pretrained(CHECKPOINT, dtype=torch.float32).eval()
    task = NIAHTask("mk-niah", str(CHECKPOINT), num_needles=8, haystack="noise")
    prompts = [task.sample(1024, i, samples=16, seed=0).input_ids for i in range(16)]
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(prompts, 8)
    print(f"threads {threads}: 16 prompts of 1K in one generate call: {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
