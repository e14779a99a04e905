#!/usr/bin/env bash
# Screen launch configurations of the qed_chunk backward for a compiler fault on the GPU: every
# CONFIGS entry (";"-separated; each a space-separated list of chunk_bwd_localize.py --set
# MODULE.NAME=VALUE items, or "defaults") runs scripts/chunk_bwd_localize.py at T=2048, H=2,
# K=V=128 in float32 and bfloat16, all in parallel processes (a fault stays in its process), and
# the summary lines are printed last: the largest relative gradient error against float64.
#   run(command="bash scripts/h200_bwd_configs.sh", carry=[".whl"])
# Output in $OUT: bwd_configs/<n>-<dtype>.log.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/bwd_configs"
source "$REPO/scripts/device_env.sh" || exit 1
W=chunk_bwd_intra.WY_BWD
ALL4="$W"_WARPS=4" chunk_bwd_intra.SCORES_BWD_WARPS=4 chunk_bwd_prep.PREP_BWD_WARPS=4 chunk_bwd_scan.STATE_WARPS=4"
CONFIGS=${CONFIGS:-"defaults;${W}_WARPS=4;${W}_BVS=32;${W}_BVS=32 ${W}_WARPS=4;${W}_BVS=64 ${W}_WARPS=4;\
chunk_bwd_scan.STATE_WARPS=4;$ALL4;$ALL4 ${W}_BVS=32"}
IFS=';' read -r -a CONFIG_LIST <<< "$CONFIGS"
cd /tmp
n=0
for cfg in "${CONFIG_LIST[@]}"; do
    sets=()
    [[ $cfg == defaults ]] || for item in $cfg; do sets+=(--set "$item"); done
    for dt in float32 bfloat16; do
        timeout "${CONFIG_SECONDS:-240}" python3 "$REPO/scripts/chunk_bwd_localize.py" --dtype $dt "${sets[@]}" \
            > "$OUT/bwd_configs/$n-$dt.log" 2>&1 &
    done
    n=$((n + 1))
done
wait
for f in "$OUT"/bwd_configs/*.log; do
    grep -q "^summary" "$f" && grep "^summary" "$f" || echo "$(basename "$f"): $(grep -E "FAILED|Error" "$f" | head -1 | cut -c1-160)"
done
