#!/usr/bin/env bash
# Retention policies end to end: ckpt train records test_loss and test_acc
# with every checkpoint (ckpt ls, ls --json, inspect --json show them);
# --keep-every and --keep-best keep exactly what the rule says on top of
# --total-limit; ckpt prune applies the same options to a finished project;
# bad options are usage errors naming the option. The kept sets are
# recomputed here from the metrics the tools print.
source "$(dirname "$0")/common.bash"

# Prints the numbers of the checkpoints a rule keeps, from "number step
# value" lines (ascending numbers) on stdin: the newest `keep`, the steps
# that are multiples of `every`, the best `k` (mode min|max; ties: newer).
expected_kept() {
    python3 -c '
import sys
keep, every, k, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rows = [tuple(l.split()) for l in sys.stdin if l.strip()]
rows = [(int(n), int(s), float(v)) for n, s, v in rows]
kept = set(n for n, _, _ in rows[-max(keep, 1):])
kept |= set(n for n, s, _ in rows if every and s % every == 0)
sign = 1 if mode == "min" else -1
best = sorted(rows, key=lambda r: (sign * r[2], -r[0]))[:k]
kept |= set(n for n, _, _ in best)
print(" ".join(str(n) for n in sorted(kept)))
' "$@"
}

# "number step test_loss" of every checkpoint of a project, from ls --json.
metrics_of() {
    "$CKPT_BIN" ls --json "$1" | python3 -c '
import json, sys
for c in json.load(sys.stdin)["checkpoints"]:
    print(c["number"], c["step"], c["metrics"]["'"$2"'"])
'
}

# ---- a full run with every checkpoint kept: the history
all=$WORK/all
run_rc 0 "$CKPT_BIN" train --epochs 2 --save-every 5 --total-limit 0 --quiet --project-dir "$all"
metrics_of "$all" test_loss >"$WORK/history"
n=$(wc -l <"$WORK/history")
[ "$n" -ge 18 ] || fail "expected a checkpoint every 5 steps, found $n"
run_rc 0 "$CKPT_BIN" ls "$all"
grep -q "complete  $all/checkpoints/checkpoint_0  test_loss=[0-9.e-]* test_acc=[0-9.e-]*$" \
    "$WORK/out" || fail "ls does not show the metrics"
run_rc 0 "$CKPT_BIN" inspect --json "$all/checkpoints/checkpoint_3"
python3 -c 'import json,sys; m=json.load(open(sys.argv[1]))["manifest"]["metrics"]; assert set(m)=={"test_loss","test_acc"} and 0<=m["test_acc"]<=1, m' \
    "$WORK/out" || fail "inspect --json: no metrics"

# ---- the same run with policies: the kept set follows the rule
pol=$WORK/pol
run_rc 0 "$CKPT_BIN" train --epochs 2 --save-every 5 --total-limit 2 --keep-every 20 \
    --keep-best test_loss:min:3 --quiet --project-dir "$pol"
want=$(expected_kept 2 20 3 min <"$WORK/history")
got=$(metrics_of "$pol" test_loss | awk '{print $1}' | tr '\n' ' ' | sed 's/ $//')
[ "$got" = "$want" ] || fail "train --keep-every 20 --keep-best test_loss:min:3: kept [$got], the rule keeps [$want]"
run_rc 0 "$CKPT_BIN" diff "$(latest_checkpoint "$all")" "$(latest_checkpoint "$pol")"
echo "train: kept $got"

# ---- prune with the same options on the project that kept everything
cp -a "$all" "$WORK/pr"
run_rc 0 "$CKPT_BIN" prune "$WORK/pr" --keep-best test_loss:max:2 --keep-every 45 --dry-run
grep -q "would remove" "$WORK/out" || fail "prune --dry-run reported nothing"
[ "$(metrics_of "$WORK/pr" test_loss | wc -l)" -eq "$n" ] || fail "a dry run removed something"
run_rc 0 "$CKPT_BIN" prune "$WORK/pr" --keep-best test_loss:max:2 --keep-every 45
want=$(expected_kept 1 45 2 max <"$WORK/history")
got=$(metrics_of "$WORK/pr" test_loss | awk '{print $1}' | tr '\n' ' ' | sed 's/ $//')
[ "$got" = "$want" ] || fail "prune: kept [$got], the rule keeps [$want]"
grep -q "the best 2 by test_loss (max)" "$WORK/out" || fail "prune: summary line"
echo "prune: kept $got"

# ---- bad options
run_rc 2 "$CKPT_BIN" train --keep-best test_loss:best:3 --project-dir "$WORK/x"
grep -q "keep-best" "$WORK/err" || fail "train: bad --keep-best mode not named"
run_rc 2 "$CKPT_BIN" train --keep-best val_loss:min:3 --project-dir "$WORK/x"
grep -q "metric 'val_loss' is not recorded" "$WORK/err" || fail "train: unknown metric"
run_rc 2 "$CKPT_BIN" train --keep-best test_loss:min:0 --project-dir "$WORK/x"
run_rc 2 "$CKPT_BIN" prune "$all" --keep-best test_loss --dry-run
grep -q "expected METRIC:min:K or METRIC:max:K" "$WORK/err" || fail "prune: bad --keep-best"
run_rc 2 "$CKPT_BIN" prune "$all" --keep-every 0
# ckpt diff shows differing metrics but does not count them as state
c1=$(ls -d "$all"/checkpoints/checkpoint_* | sort -V | sed -n 2p)
c2=$(ls -d "$all"/checkpoints/checkpoint_* | sort -V | sed -n 3p)
run_rc 1 "$CKPT_BIN" diff "$c1" "$c2"
grep -q "^checkpoint.json: metric test_loss: .* vs .* (metrics are not compared as state)" "$WORK/out" \
    || { cat "$WORK/out" >&2; fail "diff does not show the metrics"; }
run_rc 0 "$CKPT_BIN" diff "$c1" "$c1"
echo "ok: metrics shown, policies keep what the rule says (train and prune)"
