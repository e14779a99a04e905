#!/usr/bin/env bash
# On the device: put the model folders under FOLDER into $OUT as one tar each (ck-<name>.tar), from
# the FIRST-th folder in name order (0-based, default 0), as many as one call brings back (at most
# MAX_FILES files, default 8, each under 16 MiB, 64 MiB together; SLOTS_USED files of $OUT already
# taken, default: what $OUT holds now), and say which folders are left for the next call. A
# folder whose tar would exceed 16 MiB is refused by name (it cannot come back this way).
#   bash scripts/pack_for_return.sh /tmp/ckpt        # then, in the next call: ... /tmp/ckpt 6
set -euo pipefail
FOLDER=${1:?usage: pack_for_return.sh FOLDER [FIRST]}
FIRST=${2:-0}
OUT=${OUT:?OUT is not set}
FILE_LIMIT=$((16 * 1024 * 1024))
TOTAL_LIMIT=$((64 * 1024 * 1024))
used_files=${SLOTS_USED:-$(find "$OUT" -maxdepth 3 -type f | wc -l)}
used_bytes=$(du -sb "$OUT" | cut -f1)
mapfile -t NAMES < <(cd "$FOLDER" && ls -d -- */ | sed 's#/$##')
i=$FIRST
while (( i < ${#NAMES[@]} )); do
    name=${NAMES[$i]}
    size=$(du -sb "$FOLDER/$name" | cut -f1)
    (( size + 10240 < FILE_LIMIT )) || { echo "pack_for_return: $name is $size bytes, over one file's 16 MiB"; exit 1; }
    (( used_files < ${MAX_FILES:-8} && used_bytes + size + 10240 < TOTAL_LIMIT )) || break
    tar -cf "$OUT/ck-$name.tar" -C "$FOLDER" "$name"
    used_files=$((used_files + 1)) used_bytes=$((used_bytes + size + 10240))
    i=$((i + 1))
done
echo "packed ${NAMES[*]:$FIRST:$((i - FIRST))}"
(( i < ${#NAMES[@]} )) && echo "left for the next call (FIRST=$i): ${NAMES[*]:$i}" || echo "nothing left"
