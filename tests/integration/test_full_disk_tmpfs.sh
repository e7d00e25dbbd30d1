#!/usr/bin/env bash
# A really full disk (not an injected fault): training on a small tmpfs fills
# it. Each failed save is a clear "No space left on device" error (exit 3)
# that leaves no temporary folder, the earlier checkpoints verify and a run
# resumes from them; once space is freed the next save succeeds and the run
# ends exactly like an uninterrupted one. Needs root (mount); otherwise, or if
# this system refuses the mount, the test is skipped (exit 77) saying why.
source "$(dirname "$0")/common.bash"

skip() {
    echo "SKIPPED: $*"
    exit 77
}
[ "$(id -u)" -eq 0 ] || skip "mounting a tmpfs needs root (running as uid $(id -u))"
disk=$WORK/disk
mkdir -p "$disk"
mount -t tmpfs -o size=8m,mode=0755 ckpt-test-full "$disk" 2>"$WORK/mount.err" \
    || skip "mount -t tmpfs was refused: $(cat "$WORK/mount.err")"
unmount() {
    umount "$disk" 2>/dev/null || umount -l "$disk" 2>/dev/null || true
    cleanup
}
trap unmount EXIT

ref=$WORK/ref
args=(--epochs 2 --save-every 10 --total-limit 2)
run_rc 0 "${TRAIN[@]}" "${args[@]}" --project-dir "$ref"
ref_final=$(latest_checkpoint "$ref")

# A checkpoint is ~1 MB; leave room for two, and a rotation needs a third.
free_kb=$(df -k --output=avail "$disk" | tail -1)
dd if=/dev/zero of="$disk/filler" bs=1k count=$((free_kb - 2600)) status=none
proj=$disk/proj

failed_save() {
    local msg
    msg=$(grep "^ckpt: save failed: save_state: .*No space left on device (at step [0-9]*)" "$WORK/err") \
        || { cat "$WORK/err" >&2; fail "$1: no clear full-disk message"; }
    ! ls -A "$proj/checkpoints" | has '\.tmp' || fail "$1: a temporary folder was left"
    run_rc 0 "$CKPT_BIN" verify "$proj"
    echo "$1: $msg"
}

# The run fills the disk: a clear error, the earlier checkpoints intact.
run_rc 3 "${TRAIN[@]}" "${args[@]}" --project-dir "$proj"
failed_save "first run"
n_before=$(ls "$proj/checkpoints" | grep -c '^checkpoint_')
[ "$n_before" -ge 1 ] || fail "no checkpoint was committed before the disk filled"

# Still full: the resumed run loads the newest checkpoint, trains, and its
# save fails the same clear way.
run_rc 3 "${TRAIN[@]}" "${args[@]}" --project-dir "$proj" --resume
failed_save "resumed on a full disk"

# Space freed: the next save succeeds and the run ends exactly as the
# uninterrupted one.
rm -f "$disk/filler"
run_rc 0 "${TRAIN[@]}" "${args[@]}" --project-dir "$proj" --resume
run_rc 0 "$CKPT_BIN" verify "$proj"
run_rc 0 "$CKPT_BIN" diff "$ref_final" "$(latest_checkpoint "$proj")"
cmp "$ref/logs/metrics.jsonl" "$proj/logs/metrics.jsonl" || fail "metrics logs differ"
echo "ok: a real full disk fails saves clearly, keeps $n_before earlier checkpoint(s), and the run resumes exactly once space is freed"
