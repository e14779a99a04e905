#!/usr/bin/env bash
# Measure the interference checkpoints (scripts/h200_interference_train.sh) for docs/RESULTS.md,
# through scripts/eval_checkpoints.sh (which this only parametrises), every sweep with --seed 0 so
# that arms and seeds pair on shared prompts (qedprobe report: McNemar QED vs GDN-2 per seed):
# * MK-NIAH, 4 needles, prose and noise haystacks, at 1x-16x L_train (2K-32K tokens); on the QED
#   arms (full, noproj) the first of these is the Table-4 strength sweep, s in -1..2;
# * MK-NIAH with 8 and 16 needles (2-4x more interference than the 4-needle cell), prose;
# * the foreign-key control of MK-NIAH 4 needles (the asked key is in no needle: a key-matching
#   model falls to <= 25 %; qedprobe.tasks.control);
# * S-NIAH-1/2/3 at 2K-32K;
# * eig (e_t, rho, ||S^T d||) of every QED arm on MK-NIAH 4 needles at 2K (noproj against the
#   theoretical bound [-0.25, 1.25]).
# The tokenizer is read from each model folder.
#
#   CKPT=/tmp/ckpt EVAL=/tmp/eval GPU_IDS=0 PER_GPU=4 bash scripts/h200_interference_eval.sh
#
# Environment: as scripts/eval_checkpoints.sh (CKPT, EVAL, GPU_IDS, PER_GPU, SAMPLES, ONLY, DEVICE);
# LENGTHS defaults to 2K,4K,8K,16K,32K.
set -euo pipefail
cd "$(dirname "$0")/.."
MK="--task mk-niah --num-needles"
export LENGTHS=${LENGTHS:-2K,4K,8K,16K,32K} STRENGTH_ARMS=${STRENGTH_ARMS:-full noproj}
export EIG=${EIG:---task mk-niah --length 2K}
export TASKS="mk4-prose|$MK 4 --haystack prose;mk4-noise|$MK 4 --haystack noise;\
mk8-prose|$MK 8 --haystack prose;mk16-prose|$MK 16 --haystack prose --lengths 2K,8K;\
mk4-prose-control|$MK 4 --haystack prose --control foreign-key --lengths 2K,8K;\
s1|--task s-niah-1;s2|--task s-niah-2;s3|--task s-niah-3"
exec bash scripts/eval_checkpoints.sh
