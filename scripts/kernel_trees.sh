#!/usr/bin/env bash
# Importable package trees of qedprobe at several commits, for timing kernel versions side by side
# in one device call (scripts/h200_kernel_versions.sh): .trees/<name>/qedprobe with kernels/ and
# hooks/ inside it, as the wheel lays them out. Each argument is COMMIT or NAME=COMMIT; "WORK" as
# the commit takes the working tree as it is now. Carry ".trees" to the device.
#   bash scripts/kernel_trees.sh d47f103 before=8223195 head=WORK
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .trees
for arg in "$@"; do
    name=${arg%%=*} commit=${arg#*=}
    dest=.trees/$name
    mkdir -p "$dest/src"
    if [[ $commit == WORK ]]; then
        cp -r qedprobe kernels hooks "$dest/src/"
    else
        git archive "$commit" qedprobe kernels hooks | tar -x -C "$dest/src"
    fi
    mv "$dest/src/qedprobe" "$dest/qedprobe"
    mv "$dest/src/kernels" "$dest/qedprobe/kernels"
    mv "$dest/src/hooks" "$dest/qedprobe/hooks"
    rm -rf "$dest/src"
    find "$dest" -name __pycache__ -prune -exec rm -rf {} +
    echo "$name: $commit ($(du -sh "$dest" | cut -f1))"
done
