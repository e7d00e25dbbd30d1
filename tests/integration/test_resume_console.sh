#!/usr/bin/env bash
# After a resume, ckpt train prints the very lines the uninterrupted run
# printed: the loss shown averages the steps since the previous line, and a
# resumed run takes the losses from before the resume from the metrics log
# (here the resume is from step 20, in the middle of the window 15..21).
source "$(dirname "$0")/common.bash"

args=("$CKPT_BIN" train --epochs 1 --save-every 10 --total-limit 0 --log-every 7)
run_rc 0 "${args[@]}" --project-dir "$WORK/a"
lines() { sed -n 's/^\(epoch [0-9]* step \([0-9]*\)\/.*\) [0-9.]* it\/s$/\2 \1/p' "$1" | awk '$1 > 20' | cut -d' ' -f2-; }
cp "$WORK/out" "$WORK/a.out"
[ "$(lines "$WORK/a.out" | wc -l)" -eq 5 ] || fail "expected 5 progress lines after step 20: $(cat "$WORK/a.out")"

# the same run, as if it had stopped right after the save at step 20
cp -r "$WORK/a" "$WORK/b"
for d in "$WORK/b"/checkpoints/checkpoint_*; do
    n=${d##*_}
    [ "$n" -gt 1 ] && rm -rf "$d"
done
run_rc 0 "${args[@]}" --project-dir "$WORK/b" --resume
has "^resumed from .*checkpoint_1 at step 20\$" <"$WORK/out" || fail "did not resume at step 20: $(cat "$WORK/out")"
cp "$WORK/out" "$WORK/b.out"
diff <(lines "$WORK/a.out") <(lines "$WORK/b.out") >&2 || fail "the resumed run's progress lines differ"
run_rc 0 "$CKPT_BIN" diff "$(latest_checkpoint "$WORK/a")" "$(latest_checkpoint "$WORK/b")"
echo "ok: the progress lines after a resume are the uninterrupted run's"
