#!/usr/bin/env bash
# One run per project, with two real processes: while a `ckpt train` run owns
# its project (from its first save or load until it exits), a second
# `ckpt train --resume` on the same project is refused at its load with a
# message naming the owner's pid and host, and `ckpt prune` is refused the
# same way; the read-only tools (ls, verify, inspect, diff) work meanwhile.
# Once the owner is killed with SIGKILL, its stale lock file is no obstacle.
source "$(dirname "$0")/common.bash"

proj=$WORK/proj
host=$(hostname)
# A long run that saves often and keeps every checkpoint (no rotation races
# with the readers below).
"$CKPT_BIN" train --epochs 500 --save-every 5 --total-limit 0 --quiet --project-dir "$proj" \
    >"$WORK/a.out" 2>&1 &
a=$!
count() { ls "$proj/checkpoints" 2>/dev/null | grep -c '^checkpoint_' || true; }
for _ in $(seq 1 1200); do
    [ "$(count)" -ge 2 ] && break
    kill -0 "$a" 2>/dev/null || { cat "$WORK/a.out" >&2; fail "the first run ended early"; }
    sleep 0.05
done
[ "$(count)" -ge 2 ] || fail "the first run saved no checkpoint in 60 s"

# A second run is refused at its first call that touches the project.
run_rc 3 "$CKPT_BIN" train --epochs 500 --save-every 5 --total-limit 0 --quiet \
    --project-dir "$proj" --resume
grep -q "^ckpt: resume: load_state: .*/checkpoints/.lock is held by another process (pid $a on host $host)" \
    "$WORK/err" || { cat "$WORK/err" >&2; fail "the refusal does not name the owner"; }
echo "second run refused: $(cat "$WORK/err")"

# prune must not pull checkpoints from under a running run.
run_rc 3 "$CKPT_BIN" prune "$proj" --keep 1
grep -q "pid $a on host $host" "$WORK/err" || { cat "$WORK/err" >&2; fail "prune: owner not named"; }
[ "$(count)" -ge 2 ] || fail "the refused prune removed checkpoints"

# Read-only tools take no lock.
run_rc 0 "$CKPT_BIN" ls "$proj"
run_rc 0 "$CKPT_BIN" verify "$proj"
run_rc 0 "$CKPT_BIN" inspect "$proj/checkpoints/checkpoint_0"
run_rc 1 "$CKPT_BIN" diff "$proj/checkpoints/checkpoint_0" "$proj/checkpoints/checkpoint_1"
kill -0 "$a" 2>/dev/null || { cat "$WORK/a.out" >&2; fail "the first run died meanwhile"; }

# The owner dies without unlocking: the kernel drops the flock, and the lock
# file that still names the dead process stops nobody.
kill -9 "$a"
wait "$a" 2>/dev/null || true
grep -q "^$a $host\$" "$proj/checkpoints/.lock" || fail "the lock file does not name the owner"
run_rc 0 "$CKPT_BIN" prune "$proj" --keep 1
[ "$(count)" -eq 1 ] || fail "prune after the owner died kept $(count) checkpoints"
run_rc 0 "$CKPT_BIN" verify "$proj"
echo "ok: one run per project; readers never blocked; a dead owner's lock is no obstacle"
