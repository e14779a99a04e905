#!/usr/bin/env bash
# Time several versions of the kernels side by side on one GPU, each in a process of its own:
#
#   scripts/kernel_versions.sh build --trees DIR NAME=COMMIT[+PATCH] ...   # in a git checkout
#   scripts/kernel_versions.sh time --trees DIR --out DIR [--bench bench/kernel_times.py] [--rounds 1] \
#       [--timeout 150] [--python "python3 -P"] [-- BENCH ARGS]            # on the GPU machine
#
# build: an importable package tree of qedprobe per argument, DIR/<NAME>/qedprobe with kernels/
#   and hooks/ inside it as the wheel lays them out, from `git archive COMMIT` (COMMIT "WORK": the
#   working tree as it is now) with, after a "+", a patch applied to its qedprobe/, kernels/ and
#   hooks/ files (a change kept as a patch file, e.g. under docs/results/), e.g.
#   `build --trees .trees before=2918ba2 head=WORK` or `norms=105e64e+docs/results/X/norms.patch`.
#   Copy DIR to the GPU machine with the working tree if it has no git history.
# time: for every tree of DIR, the benchmark script `--bench` (of this checkout; default
#   bench/kernel_times.py) with that tree first on PYTHONPATH, into OUT/<script>-<NAME>.json and
#   .log, then each tree's rows; with `--rounds N` the trees take turns N times (files
#   OUT/<script>-<NAME>-r<R>.*), so that a drift of the machine touches every tree alike. The
#   default arguments of bench/kernel_times.py are `--quick --parts` (the main shape, probes off
#   and on, the order check, per-kernel times, forward + backward, fla in the same process);
#   `-- --quick --parts --no-fla --fla-ms 2.011 --fla-fwd-bwd-ms 11.18` reuses fla's times instead
#   of measuring them in every process. `--bench bench/hf_models.py -- --sections op --op-shapes
#   8x4096` times the real-model op against fla in each process (its rows' ratios are printed).
# Changing a launch constant is a version like any other: edit it in the working tree and build
# `head=WORK` beside the commit before it.
set -uo pipefail
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "kernel_versions.sh: $*" >&2; exit 2; }
REPO=$(cd "$(dirname "$0")/.." && pwd)

build() {  # build NAME=COMMIT ...: DIR/<NAME>/qedprobe for each
    local arg name commit dest patch src
    (($#)) || die "build needs NAME=COMMIT arguments"
    for arg in "$@"; do
        [[ $arg == *=* ]] || die "build: '$arg' is not NAME=COMMIT"
        name=${arg%%=*} commit=${arg#*=} dest=$TREES/${arg%%=*} patch="" src=""
        if [[ $commit == *+* ]]; then
            patch=$(cd "$REPO" && realpath -e "${commit#*+}") || die "$name: no patch file ${commit#*+}"
            commit=${commit%%+*}
        fi
        # Staged outside any git repository: inside one (DIR under the checkout), `git apply` takes
        # the patch's paths from that repository's root and silently skips them all.
        src=$(mktemp -d)
        if [[ $commit == WORK ]]; then
            (cd "$REPO" && cp -r qedprobe kernels hooks "$src/")
        else
            git -C "$REPO" archive "$commit" qedprobe kernels hooks | tar -x -C "$src" \
                || { rm -rf "$src"; die "no commit $commit"; }
        fi
        if [[ -n $patch ]]; then
            (cd "$src" && GIT_CEILING_DIRECTORIES=$src/.. git apply --include='qedprobe/*' --include='kernels/*' \
                --include='hooks/*' "$patch") || { rm -rf "$src"; die "$name: $patch does not apply to $commit"; }
        fi
        rm -rf "$dest" && mkdir -p "$dest"
        mv "$src/qedprobe" "$dest/qedprobe"
        mv "$src/kernels" "$src/hooks" "$dest/qedprobe/"
        rm -rf "$src"
        find "$dest" -name __pycache__ -prune -exec rm -rf {} +
        echo "$name: $commit${patch:+ + $patch} ($(du -sh "$dest" | cut -f1))"
    done
}

time_trees() {  # time [BENCH ARGS]: every tree of DIR in its own process, ROUNDS times
    local tree name round file stem script args=("$@")
    script=$(cd "$REPO" && realpath -e "$BENCH") || die "--bench: no script $BENCH"
    stem=$(basename "$script" .py)
    [[ $stem == kernel_times && ${#args[@]} -eq 0 ]] && args=(--quick --parts)
    [[ -n $OUT ]] || die "time needs --out DIR"
    [[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "--rounds: expected a positive integer, got '$ROUNDS'"
    mkdir -p "$OUT"
    OUT=$(cd "$OUT" && pwd)
    cd "$(mktemp -d)" || exit 1  # a source checkout in the working directory is not imported
    for ((round = 1; round <= ROUNDS; round++)); do
        for tree in "$TREES"/*/; do
            name=$(basename "$tree")
            file=$OUT/$stem-$name
            ((ROUNDS > 1)) && file+=-r$round
            # shellcheck disable=SC2086
            PYTHONPATH=${tree%/}${PYTHONPATH:+:$PYTHONPATH} timeout "$TIMEOUT" $PY "$script" \
                "${args[@]}" --commit "$name" --json "$file.json" > "$file.log" 2>&1
            echo "== $name${file##*-$name} (exit $?)"
            grep -E "^\| (qed_chunk|  qed)|ratio" "$file.log" | cut -c1-130
        done
    done
}

MODE=${1:-}
[[ $MODE == -h || $MODE == --help ]] && usage
[[ $MODE == build || $MODE == time ]] || die "first argument: build or time (--help)"
shift
TREES="" OUT="" TIMEOUT=150 PY="python3 -P" BENCH=bench/kernel_times.py ROUNDS=1 REST=()
while (($#)); do
    case $1 in
        -h | --help) usage ;;
        --) shift; REST+=("$@"); break ;;
        --trees | --out | --timeout | --python | --bench | --rounds)
            [[ $# -ge 2 ]] || die "$1 needs a value"
            case $1 in
                --trees) TREES=$2 ;; --out) OUT=$2 ;; --timeout) TIMEOUT=$2 ;; --python) PY=$2 ;;
                --bench) BENCH=$2 ;; --rounds) ROUNDS=$2 ;;
            esac
            shift 2 ;;
        --*) die "unknown argument '$1' (--help lists them)" ;;
        *) REST+=("$1"); shift ;;
    esac
done
[[ -n $TREES ]] || die "--trees DIR is required"
mkdir -p "$TREES"
TREES=$(cd "$TREES" && pwd)
if [[ $MODE == build ]]; then build "${REST[@]}"; else time_trees "${REST[@]}"; fi
