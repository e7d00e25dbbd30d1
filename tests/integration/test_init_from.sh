#!/usr/bin/env bash
# ckpt train --init-from: a new run starts from another run's model weights
# (ckpt_load_state_ex with the models only) and a fresh optimizer, schedule
# and data order at step 0, in its own project with its own numbering. Its
# first losses are the trained model's, far below a fresh model's; --resume
# and --init-from exclude each other; a folder that is no checkpoint is a
# clear usage error and leaves nothing behind.
source "$(dirname "$0")/common.bash"

first_loss() { # the loss of the first step logged in a project's metrics
    python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["loss"])' \
        "$1/logs/metrics.jsonl"
}

# a pretraining run
run_rc 0 "$CKPT_BIN" train --epochs 2 --save-every 0 --quiet --project-dir "$WORK/pre"
pre=$(latest_checkpoint "$WORK/pre")
pre_step=$("$CKPT_BIN" ls --json "$WORK/pre" | python3 -c 'import json,sys; print(json.load(sys.stdin)["checkpoints"][-1]["step"])')

# fine-tuning from it: the same data here, a new project
run_rc 0 "$CKPT_BIN" train --epochs 1 --save-every 20 --total-limit 0 --seed 5 --project-dir "$WORK/ft" \
    --init-from "$pre" --log-every 1
grep -q "initialised the model from $pre (its step $pre_step)" "$WORK/out" || {
    cat "$WORK/out" >&2
    fail "no init line"
}
# its own numbering and steps: checkpoint_0 at step 20
"$CKPT_BIN" ls --json "$WORK/ft" | python3 -c '
import json, sys
c = json.load(sys.stdin)["checkpoints"]
assert c[0]["number"] == 0 and c[0]["step"] == 20, c[0]
' || fail "the fine-tuning run does not number from 0 / step 20"

# a fresh run with the same settings, for comparison
run_rc 0 "$CKPT_BIN" train --epochs 1 --save-every 0 --seed 5 --quiet --project-dir "$WORK/fresh" --log-every 1
ft=$(first_loss "$WORK/ft")
fresh=$(first_loss "$WORK/fresh")
python3 -c "import sys; a, b = float(sys.argv[1]), float(sys.argv[2]); sys.exit(0 if a < 0.5 * b else 1)" \
    "$ft" "$fresh" || fail "first loss $ft after --init-from is not well below a fresh model's $fresh"

# the fine-tuning run resumes like any run (from its own checkpoints)
run_rc 0 "$CKPT_BIN" train --epochs 1 --save-every 20 --total-limit 0 --seed 5 --quiet --project-dir "$WORK/ft" --resume

# exclusive with --resume
run_rc 2 "$CKPT_BIN" train --project-dir "$WORK/x" --init-from "$pre" --resume
grep -q "exclude each other" "$WORK/err" || fail "no message for --init-from with --resume"

# a project folder stands for its newest valid checkpoint: the same weights
# as that checkpoint's, so the same first loss as the fine-tuning run above
run_rc 0 "$CKPT_BIN" train --epochs 1 --save-every 0 --seed 5 --project-dir "$WORK/fp" \
    --init-from "$WORK/pre" --log-every 1
grep -q "initialised the model from $pre (its step $pre_step)" "$WORK/out" || {
    cat "$WORK/out" "$WORK/err" >&2
    fail "--init-from a project does not take its newest checkpoint"
}
[ "$(first_loss "$WORK/fp")" = "$ft" ] || fail "--init-from a project: another first loss"
# a project without a valid checkpoint: refused, nothing saved
mkdir -p "$WORK/empty/checkpoints"
run_rc 3 "$CKPT_BIN" train --quiet --project-dir "$WORK/y" --init-from "$WORK/empty"
grep -q "project $WORK/empty has no valid checkpoint" "$WORK/err" || { cat "$WORK/err" >&2; fail "empty project"; }
[ ! -e "$WORK/y/checkpoints/checkpoint_0" ] || fail "a failed --init-from left a checkpoint"
# not a checkpoint: a missing folder
run_rc 2 "$CKPT_BIN" train --quiet --project-dir "$WORK/y" --init-from "$WORK/nothing"
grep -q "not a checkpoint folder nor a project" "$WORK/err" || { cat "$WORK/err" >&2; fail "no message for a missing folder"; }
[ ! -e "$WORK/y/checkpoints/checkpoint_0" ] || fail "a failed --init-from left a checkpoint"

# a corrupt checkpoint: refused, nothing saved
cp -r "$pre" "$WORK/bad"
flip_byte "$WORK/bad/model.safetensors" 200
run_rc 3 "$CKPT_BIN" train --quiet --project-dir "$WORK/z" --init-from "$WORK/bad"
grep -q "model.safetensors" "$WORK/err" || { cat "$WORK/err" >&2; fail "the corrupt file is not named"; }
[ ! -e "$WORK/z/checkpoints/checkpoint_0" ] || fail "a failed --init-from left a checkpoint"
echo "ok"
