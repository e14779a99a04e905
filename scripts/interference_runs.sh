# Sourced by scripts/h200_interference_lease.sh and scripts/h200_interference_screen.sh: what both
# do with the training runs under $RUNS (and the evaluation under $EVAL) on the device.

# Each run's last train.log line.
runs_status() {
    for f in "$RUNS"/*/train.log; do [[ -f $f ]] && echo "$(basename "$(dirname "$f")"): $(tail -1 "$f")"; done
}

# pack_runs_and_eval TGZ LOG...: every run's loss.jsonl and train.log plus the driver LOGs, with
# $EVAL, into TGZ (one file of what a call brings back).
pack_runs_and_eval() {
    local tgz=$1 r n
    shift
    mkdir -p /tmp/pack/train
    for r in "$RUNS"/*/; do
        n=$(basename "$r")
        mkdir -p "/tmp/pack/train/$n"
        cp "$r"/loss.jsonl "$r"/train.log "/tmp/pack/train/$n/" 2> /dev/null
    done
    cp "$@" /tmp/pack/train/
    tar czf "$tgz" -C "$(dirname "$EVAL")" "$(basename "$EVAL")" -C /tmp/pack train
}
