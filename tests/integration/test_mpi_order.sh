#!/usr/bin/env bash
# Ranks that save different state under real mpirun (-np 2 and 4): the last
# rank's first tensor has another shape or name, its objects come in another
# order, or it has one object more (tests/progs/mpi/order_run.c). Checked:
#  - every rank returns the same CKPT_EINVAL, naming the first object that
#    differs and the rank;
#  - nothing was committed and no temporary folder is left; the first
#    checkpoint verifies;
#  - with the same state on every rank the second save commits.
source "$(dirname "$0")/common.bash"

mpi_setup
PROG=$CKPT_BUILD_DIR/tests/order_run
[ -x "$PROG" ] || fail "$PROG is not built"

run_case() { # run_case P CASE WANT (WANT: the expected message after "rank 0: save_state: <target>: ")
    local p=$1 c=$2 want=$3 dir=$WORK/p$1$2 out=$WORK/p$1$2.out r got
    mkdir -p "$dir"
    mpirun --oversubscribe -np "$p" "$PROG" "$dir" "$c" >"$out" 2>"$WORK/err" ||
        { cat "$out" "$WORK/err" >&2; fail "P=$p $c: the job failed"; }
    local target=$dir/checkpoints/checkpoint_1
    for ((r = 0; r < p; r++)); do
        got=$(grep "^rank $r save1 " "$out")
        [ "$got" = "rank $r save1 CKPT_OK " ] || fail "P=$p $c rank $r save1: $got"
        got=$(grep "^rank $r save2 " "$out")
        if [ "$c" = same ]; then
            [ "$got" = "rank $r save2 CKPT_OK " ] || fail "P=$p $c rank $r save2: $got"
        else
            [ "$got" = "rank $r save2 CKPT_EINVAL rank 0: save_state: $target: $want" ] ||
                fail "P=$p $c rank $r save2: $got"
        fi
    done
    if compgen -G "$dir/checkpoints/.checkpoint_*" >/dev/null; then
        fail "P=$p $c: a temporary folder was left: $(ls -a "$dir/checkpoints")"
    fi
    if [ "$c" = same ]; then
        [ -d "$target" ] || fail "P=$p $c: $target was not committed"
    else
        [ ! -e "$target" ] || fail "P=$p $c: $target was committed"
    fi
    run_rc 0 "$CKPT_BIN" verify "$dir"
}

for p in 2 4; do
    last=$((p - 1))
    differs="the ranks save different state: custom_checkpoint_0.safetensors differs between rank 0 and rank $last (the names, order, dtypes or shapes of its replicated tensors: 1 on rank 0, 1 on rank $last)"
    run_case "$p" same ""
    run_case "$p" shape "$differs"
    run_case "$p" name "$differs"
    run_case "$p" order "$differs"
    run_case "$p" extra "the ranks save different objects: rank 0 saves nothing where rank $last saves custom_checkpoint_2.safetensors"
done
echo "PASS: ranks that save different state fail alike and commit nothing"
