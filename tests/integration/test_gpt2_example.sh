#!/usr/bin/env bash
# The GPT-2 trainer of examples/gpt2 (llm.c's shape: one bf16 parameter
# block, its own AdamW with fp32 masters, tied embedding, a token shard
# loader with its own generator):
#  - the lines that make it resumable, marked "// ckpt begin" / "// ckpt
#    end", are fewer than 40 (non-blank);
#  - scripts/demo-gpt2 (the part of `make demo` that kills it with SIGKILL
#    at a random moment and resumes it; here 24 steps, an asynchronous
#    save every 8)
#    reports it bit for bit: the same final checkpoint (ckpt diff), the same
#    losses after the resume, the same validation loss; the resumed
#    checkpoint verifies and exports (--bin), and the export, loaded into a
#    GPT-2 module in PyTorch (tests/python/test_gpt2_example.py --export),
#    gives the resumed run's validation loss to 1e-5 relative.
# (test_demo runs the demo without this part: it runs once in the suite.)
# The export's numbers in PyTorch: tests/python/test_gpt2_example.py.
source "$(dirname "$0")/common.bash"

src=$CKPT_SOURCE_DIR/examples/gpt2/train_gpt2.c
[ -x "$CKPT_BUILD_DIR/example_gpt2" ] || fail "$CKPT_BUILD_DIR/example_gpt2 is not built"

n=$(awk '/\/\/ ckpt begin/{on=1;next} /\/\/ ckpt end/{on=0;next} on && NF' "$src" | wc -l)
blocks=$(grep -c '// ckpt begin' "$src")
[ "$blocks" -eq "$(grep -c '// ckpt end' "$src")" ] || fail "unbalanced ckpt markers"
[ "$n" -gt 20 ] && [ "$n" -lt 40 ] || fail "$n marked lines (expected fewer than 40)"
echo "$n lines in $blocks marked blocks"

# the first kill lands at once, before any save: the script must kill again
CKPT_DEMO_FIRST_KILL_PCT=0 CKPT_DEMO_GPT2_STEPS=24 run_rc 0 \
    bash "$CKPT_SOURCE_DIR/scripts/demo-gpt2" "$CKPT_BUILD_DIR" "$WORK/demo"
cat "$WORK/out"
has "^gpt2: resumed from step [0-9]*, ended bit for bit$" <"$WORK/out" || fail "no verdict"
has "^equal: .* bit for bit$" <"$WORK/out" || fail "ckpt diff did not say equal"
has "^kill -9 after " <"$WORK/out" || fail "the run was not killed"
has "^(the kill landed before the first save" <"$WORK/out" || fail "the early kill was not retried"
[ -f "$WORK/demo/gpt2-export/pytorch_model.bin" ] || fail "no export"
if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
    has "^ok: 16 parameters (lm_head tied to wte), loss equal" <"$WORK/out" ||
        fail "the export was not checked in PyTorch"
fi
echo "ok: the GPT-2 example resumes bit for bit with $n lines of ckpt"
