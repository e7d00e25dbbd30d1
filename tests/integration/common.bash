# common.bash — shared by the integration tests (sourced, not run: only *.sh
# files are tests). Gives: $WORK (a fresh folder, removed on exit), fail,
# run_rc, latest_checkpoint, and TRAIN (the small training run the tests use).
set -euo pipefail

: "${CKPT_BIN:?set CKPT_BIN to the ckpt tool}"
if [ -z "${CKPT_DATA:-}" ] && [ -n "${CKPT_SOURCE_DIR:-}" ]; then
    export CKPT_DATA="$CKPT_SOURCE_DIR/data/digits.csv.gz"
fi

WORK=$(mktemp -d /tmp/ckpt-test.XXXXXX)
cleanup() {
    local pids
    pids=$(jobs -p)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT

# has PATTERN: like `grep -q PATTERN` at the end of a pipeline, but reads all
# of its input first, so the writer never dies of SIGPIPE (which pipefail
# would report as a failure).
has() {
    local input
    input=$(cat)
    grep -q "$@" <<<"$input"
}

fail() {
    echo "FAIL: $*" >&2
    exit 1
}

# run_rc WANT CMD...: runs CMD, fails unless it exits with WANT; its stdout
# and stderr go to $WORK/out and $WORK/err.
run_rc() {
    local want=$1 rc=0
    shift
    "$@" >"$WORK/out" 2>"$WORK/err" || rc=$?
    if [ "$rc" -ne "$want" ]; then
        echo "--- stdout:" >&2; cat "$WORK/out" >&2
        echo "--- stderr:" >&2; cat "$WORK/err" >&2
        fail "expected exit $want, got $rc: $*"
    fi
}

# The newest checkpoint folder of a project (highest number).
latest_checkpoint() {
    local d n best=-1 bestdir=
    for d in "$1"/checkpoints/checkpoint_*; do
        [ -d "$d" ] || continue
        n=${d##*_}
        case $n in *[!0-9]*) continue ;; esac
        if [ "$n" -gt "$best" ]; then best=$n; bestdir=$d; fi
    done
    [ -n "$bestdir" ] || fail "no checkpoint in $1"
    echo "$bestdir"
}

# Flips one byte (xor 0xff) at offset $2 of file $1.
flip_byte() {
    local f=$1 off=$2 b
    b=$(od -An -tu1 -j "$off" -N1 "$f" | tr -d ' ')
    printf "$(printf '\\%03o' $((b ^ 255)))" | dd of="$f" bs=1 seek="$off" count=1 conv=notrunc status=none
}

# A short run: 2 epochs of 46 steps, frequent saves.
TRAIN=("$CKPT_BIN" train --epochs 2 --save-every 4 --quiet)

# mpi_setup: skips the test (exit 77) without mpirun or an MPI build, else
# sets what an Open MPI job needs here: as root both confirmations; Open
# MPI's own allocations kept to the end are suppressed by frame names, which
# needs full stacks and its components kept loaded; two cores for up to four
# ranks: never busy-wait; one node: only the shared-memory transport.
mpi_setup() {
    if ! command -v mpirun >/dev/null 2>&1; then
        echo "SKIP: mpirun not found (scripts/setup test installs openmpi-bin)"
        exit 77
    fi
    if [ "${CKPT_HAVE_MPI:-1}" != 1 ]; then
        echo "SKIP: this build has no MPI (libopenmpi-dev was missing when it was configured)"
        exit 77
    fi
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    export OMPI_MCA_mca_base_component_disable_dlclose=1
    export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}fast_unwind_on_malloc=0"
    export OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_btl=self,vader OMPI_MCA_pml=ob1
}
