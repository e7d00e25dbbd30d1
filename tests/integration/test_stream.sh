#!/usr/bin/env bash
# A load of many processes streams the replicated tensors while the objects
# read them (docs/DISTRIBUTED.md, "Who receives what"), under real mpirun
# (-np 2 and 4; check and slice with -np 2 only; tests/progs/mpi/stream_run.c).
# Checked, per case:
#  - same:   every rank gets every saved value back;
#  - order:  the last rank reads the replicated tensors in another order:
#            every rank returns the same CKPT_EINVAL saying so, no rank hangs;
#  - refuse: the last rank's load_state_dict refuses before reading: every
#            rank returns that rank's own error (not the others' echo of it);
#  - check:  every check_state_dict reads a streamed tensor (check phase) and
#            the last rank's refuses: the same error on every rank, nothing
#            changed anywhere;
#  - slice:  the last rank's check reads rows it was never sent: the same
#            CKPT_EMISMATCH on every rank, naming the key and the file,
#            nothing changed anywhere;
#  - corrupt: the last rank's communicator flips a bit of what it receives:
#            its digest check refuses the chunk, every rank returns that
#            CKPT_ECORRUPT (the others' echoes are not reported);
# and after a failed load every rank refuses to save (nothing to trust).
source "$(dirname "$0")/common.bash"

mpi_setup
PROG=$CKPT_BUILD_DIR/tests/stream_run
[ -x "$PROG" ] || fail "$PROG is not built"

run_case() { # run_case P CASE STATUS MESSAGE VALUES SAVE (VALUES -: not checked)
    local p=$1 c=$2 status=$3 want=$4 values=$5 save=$6 dir=$WORK/p$1$2 out r got first=
    out=$WORK/p$1$2.out
    mkdir -p "$dir"
    timeout 300 mpirun --oversubscribe -np "$p" "$PROG" "$dir" "$c" >"$out" 2>"$WORK/err" ||
        { cat "$out" "$WORK/err" >&2; fail "P=$p $c: the job failed"; }
    for ((r = 0; r < p; r++)); do
        got=$(grep "^rank $r load " "$out") || fail "P=$p $c: rank $r printed no load line"
        case "$got" in
        "rank $r load $status "*) ;;
        *) fail "P=$p $c rank $r load: $got (expected $status)" ;;
        esac
        [ -z "$want" ] || [[ $got == *"$want"* ]] || fail "P=$p $c rank $r: '$got' lacks '$want'"
        got=${got#"rank $r load "}
        [ -z "$first" ] && first=$got
        [ "$got" = "$first" ] || fail "P=$p $c: rank $r says '$got', rank 0 '$first'"
        got=$(grep "^rank $r values " "$out")
        [ "$values" = - ] || [ "$got" = "rank $r values $values" ] ||
            fail "P=$p $c rank $r: $got (expected $values)"
        got=$(grep "^rank $r save " "$out")
        [ "$got" = "rank $r save $save " ] || fail "P=$p $c rank $r save: $got (expected $save)"
    done
    run_rc 0 "$CKPT_BIN" verify "$dir"
}

for p in 2 4; do
    last=$((p - 1))
    run_case "$p" same CKPT_OK "" saved CKPT_OK
    run_case "$p" order CKPT_EINVAL "the ranks read replicated state in different orders" \
        sentinel CKPT_EINVAL
    run_case "$p" refuse CKPT_EINVAL "rank $last: load_state: " sentinel CKPT_EINVAL
    grep -q "load_state_dict returned CKPT_EINVAL" "$WORK/p${p}refuse.out" ||
        fail "P=$p refuse: the refusing rank's own error was not the one returned"
    run_case "$p" corrupt CKPT_ECORRUPT "rank $last: load_state: " - CKPT_EINVAL
    grep -q "received from rank [0-9]* differs from the manifest's digest" "$WORK/p${p}corrupt.out" ||
        fail "P=$p corrupt: the digest check was not the error returned"
    [ "$p" = 2 ] || continue # the check-phase cases, once (the suite's time)
    run_case "$p" check CKPT_EINVAL "rank $last: load_state: " sentinel CKPT_EINVAL
    grep -q "check_state_dict returned CKPT_EINVAL" "$WORK/p${p}check.out" ||
        fail "P=$p check: the refusing rank's own error was not the one returned"
    run_case "$p" slice CKPT_EMISMATCH "key 's': the chunk at offsets [0,0] is in custom_checkpoint_0-00001-of-0000$p.safetensors, which this process did not receive" \
        sentinel CKPT_EINVAL
done
echo "PASS: streamed loads of 2 and 4 ranks: values, and every failure alike on every rank"
