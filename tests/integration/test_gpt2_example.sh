#!/usr/bin/env bash
# The GPT-2 trainer of examples/gpt2 (llm.c's shape: one bf16 parameter
# block, its own AdamW with fp32 masters, tied embedding, a token shard
# loader with its own generator):
#  - the lines that make it resumable, marked "// ckpt begin" / "// ckpt
#    end", are fewer than 40 (non-blank);
#  - killed with SIGKILL at a random moment (saves every 4 steps,
#    asynchronous) and resumed, it ends bit for bit where an uninterrupted
#    run ends: the same final checkpoint (ckpt diff), the same losses after
#    the resume, the same validation loss.
# The export's numbers in PyTorch: tests/python/test_gpt2_example.py.
source "$(dirname "$0")/common.bash"

src=$CKPT_SOURCE_DIR/examples/gpt2/train_gpt2.c
ex=$CKPT_BUILD_DIR/example_gpt2
[ -x "$ex" ] || fail "$ex is not built"

n=$(awk '/\/\/ ckpt begin/{on=1;next} /\/\/ ckpt end/{on=0;next} on && NF' "$src" | wc -l)
blocks=$(grep -c '// ckpt begin' "$src")
[ "$blocks" -eq "$(grep -c '// ckpt end' "$src")" ] || fail "unbalanced ckpt markers"
[ "$n" -gt 20 ] && [ "$n" -lt 40 ] || fail "$n marked lines (expected fewer than 40)"
echo "$n lines in $blocks marked blocks"

args=(--steps 24 --save-every 4)
"$ex" "$WORK/a" "${args[@]}" >"$WORK/a.log" || fail "uninterrupted run failed"
for attempt in 1 2 3 4 5 6; do
    rm -rf "$WORK/b"
    "$ex" "$WORK/b" "${args[@]}" >"$WORK/b0.log" 2>&1 &
    pid=$!
    # kill once some steps are done (and maybe a save is under way)
    want=$((6 + RANDOM % 12))
    while kill -0 "$pid" 2>/dev/null && [ "$(grep -c '^step ' "$WORK/b0.log")" -lt "$want" ]; do
        sleep 0.02
    done
    kill -9 "$pid" 2>/dev/null && { wait "$pid" 2>/dev/null || true; break; }
    wait "$pid" || true
done
killed=$(grep -c '^step ' "$WORK/b0.log")
"$ex" "$WORK/b" "${args[@]}" >"$WORK/b.log" || fail "resumed run failed: $(cat "$WORK/b.log")"
from=$(sed -n 's/^resumed at step \([0-9]*\)$/\1/p' "$WORK/b.log")
[ -n "$from" ] || fail "killed after $killed steps, nothing resumed: $(head -3 "$WORK/b.log")"
echo "killed after $killed steps, resumed at step $from"
grep '^step ' "$WORK/a.log" | tail -n +"$((from + 1))" >"$WORK/a.steps"
grep '^step ' "$WORK/b.log" >"$WORK/b.steps"
cmp -s "$WORK/a.steps" "$WORK/b.steps" || fail "losses after the resume differ: $(diff "$WORK/a.steps" "$WORK/b.steps" | head -5)"
[ "$(tail -n 1 "$WORK/a.log")" = "$(tail -n 1 "$WORK/b.log")" ] || fail "validation losses differ"
run_rc 0 "$CKPT_BIN" verify "$WORK/b"
run_rc 0 "$CKPT_BIN" diff "$(latest_checkpoint "$WORK/a")" "$(latest_checkpoint "$WORK/b")"
has "bit for bit" <"$WORK/out" || fail "final checkpoints differ: $(cat "$WORK/out")"
echo "ok: the GPT-2 example resumes bit for bit with $n lines of ckpt"
