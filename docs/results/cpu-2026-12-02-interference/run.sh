#!/usr/bin/env bash
# CPU evaluation of the nine interference checkpoints: MK-NIAH 8 needles (noise) at 2K and 4 needles at 8K, s = 1.
cd /work/main
for cell in "8 2K 20" "4 8K 12"; do
  read n len samples <<< "$cell"
  for a in gdn2 full noproj; do for s in 0 1 2; do
    OMP_NUM_THREADS=1 .venv/bin/qedprobe sweep --model checkpoints/interference-$a-s$s --format legacy --task mk-niah \
      --num-needles $n --haystack noise --lengths $len --strengths 1 --samples $samples --batch-size 4 \
      --out runs/cpu-eval-s8/mk-n$n-$len/interference-$a-s$s --no-progress 2>&1 | grep "^| [0-9]"
  done; done
done
echo ALL DONE
