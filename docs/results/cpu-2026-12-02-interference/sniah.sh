#!/usr/bin/env bash
# CPU: S-NIAH-1/2/3 at 2K (the training length), 12 prompts, s = 1, the nine interference checkpoints.
cd /work/main
for t in s-niah-1 s-niah-2 s-niah-3; do
  for a in gdn2 full noproj; do for s in 0 1 2; do
    OMP_NUM_THREADS=1 .venv/bin/qedprobe sweep --model checkpoints/interference-$a-s$s --format legacy --task $t \
      --lengths 2K --strengths 1 --samples 12 --batch-size 4 \
      --out runs/cpu-eval-s8/$t-2K/interference-$a-s$s --no-progress 2>&1 | grep "^| [0-9]" | sed "s/^/$t $a-s$s /"
  done; done
done
echo ALL DONE
