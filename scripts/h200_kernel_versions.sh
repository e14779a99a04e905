#!/usr/bin/env bash
# Time several versions of the qed_chunk kernels in one device call: for every tree under .trees/
# (made here by scripts/kernel_trees.sh), bench/kernel_times.py --quick --parts --no-fla in its own
# process with that tree first on PYTHONPATH: the forward (probes off and on), the
# order check, per-kernel times and the forward + backward at B8 T4096 H16 K=V=128 bf16, ratios
# against fla's times given as FLA_MS / FLA_FWD_BWD_MS (default: the H200 figures of
# docs/BENCHMARKS.md). Wheels as for every device script.
#   run(command="bash scripts/h200_kernel_versions.sh", carry=[".whl", ".trees"])
# Output in $OUT: kernels-<tree>.json and .log; the forward rows of each are printed last.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source "$REPO/scripts/device_env.sh" || exit 1
site=$PYTHONPATH
cd /tmp
for tree in "$REPO"/.trees/*/; do
    name=$(basename "$tree")
    PYTHONPATH=$tree:$site timeout "${TREE_SECONDS:-150}" python3 "$REPO/bench/kernel_times.py" --quick --parts --no-fla \
        --fla-ms "${FLA_MS:-2.011}" --fla-fwd-bwd-ms "${FLA_FWD_BWD_MS:-11.18}" --commit "$name" \
        --json "$OUT/kernels-$name.json" > "$OUT/kernels-$name.log" 2>&1
    echo "== $name (exit $?)"
    grep -E "^\| (qed_chunk|  qed)" "$OUT/kernels-$name.log" | cut -c1-110
done
