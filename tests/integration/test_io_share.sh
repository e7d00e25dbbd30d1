#!/usr/bin/env bash
# Proof by counting that a job of P processes saves and loads its checkpoint
# at about 1/P per rank: tests/progs/mpi/io_share.c counts the bytes each rank's
# library reads and writes on files (every pread, mmap, write), for a data
# parallel state, a ZeRO-1 one and a fully sharded custom object under
# mpirun -np 1, 2, 3 and 4 (and, with -np 1 and 3, a data parallel state
# whose model is saved as Hugging Face shards, and one whose model is half
# frozen). For the save and for the load: the most one rank
# moves is at most 1.25 x state/P + 1 MiB, the bytes read by all ranks at
# most 1.25 x state (not for the half-frozen model, whose trainable tensors
# rank 0 writes and reads whole); during the load a rank holds at most
# 1.25 x state/P + 3 MiB (not for the half-frozen model either), and at
# most the streaming window + 64 KiB beyond what it read itself (every
# layout); the load gives back the saved values bit for bit; a
# second save of the unchanged state writes no state file on any rank: each
# rank links its own files (incremental saves).
# What 3 processes saved is what 1 saved, for ckpt diff, export and
# ckpt_torch.
#
# The suite runs it as several tests side by side (tests/CMakeLists.txt):
# CKPT_IO_SHARE_LAYOUTS selects the layouts (default all), CKPT_IO_SHARE_RESHARD
# the P:Q pairs of the reshard part (default all; "none": none) and
# CKPT_IO_SHARE_V1=0 skips the format version 1 fixture.
source "$(dirname "$0")/common.bash"

mpi_setup
PROG=$CKPT_BUILD_DIR/tests/io_share
[ -x "$PROG" ] || fail "$PROG was not built"
LAYOUTS=${CKPT_IO_SHARE_LAYOUTS-dp zero1 sharded hf frozen}
PAIRS=${CKPT_IO_SHARE_RESHARD:-1:3 2:4 4:2 3:2 4:1}
[ "$PAIRS" = none ] && PAIRS=

for layout in $LAYOUTS; do
    ps="1 2 3 4"
    [ "$layout" = frozen ] || [ "$layout" = hf ] && ps="1 3"
    for p in $ps; do
        mpirun --oversubscribe -np "$p" "$PROG" "$WORK" "$layout" >"$WORK/out" 2>"$WORK/err" || {
            cat "$WORK/out" "$WORK/err" >&2
            fail "io_share $layout on $p processes"
        }
        cat "$WORK/out"
        grep -q "second save: every rank linked its own files" "$WORK/out" ||
            fail "io_share $layout on $p processes: the second save did not link every file"
        [ "$p" = 1 ] || [ "$p" = 3 ] || rm -rf "${WORK:?}/$layout-$p"
    done
    # Saved by 3 processes (format version 2, replicated tensors spread over
    # the ranks' shard files), the checkpoint holds what one process saved:
    # ckpt verify, diff and export read it, and so does ckpt_torch.
    one=$(latest_checkpoint "$WORK/$layout-1") three=$(latest_checkpoint "$WORK/$layout-3")
    grep -q '"format_version": 2' "$three/checkpoint.json" || fail "$three: not format version 2"
    # (a half-frozen model's frozen tensors are in shard files of their own
    # even with one process: format version 2)
    [ "$layout" = frozen ] || grep -q '"format_version": 1' "$one/checkpoint.json" ||
        fail "$one: not format version 1"
    # The plan lays the small tensors first, so those falling to rank 0 (here
    # the optimizer's step counts, scalars) stay in their object's file: no
    # chunk record for them. Every chunk record is one compact line.
    if grep -q '"global_shape":\[\]' "$three/checkpoint.json"; then
        fail "$three: a scalar has a chunk record"
    fi
    dims='\[[0-9,]+\]'
    rec="^      \"[^\"]+\": \\{\"dtype\":\"F32\",\"global_shape\":$dims,"
    rec+="\"offsets\":$dims,\"shape\":$dims\\}"
    grep -qE "$rec" "$three/checkpoint.json" || fail "$three: no chunk record on a line of its own"
    if [ "$layout" = hf ]; then
        # The model's four Hugging Face shards, 2 MiB each, are spread over
        # the 3 ranks by bytes (largest first to the rank with the fewest:
        # 0, 1, 2, 0); rank 0 writes the index.
        for s in 1:0 2:1 3:2 4:0; do
            k=${s%:*} r=${s#*:} rk=
            [ "$r" = 0 ] || rk=" \"rank\": $r,"
            head="{\"name\": \"model-0000$k-of-00004.safetensors\", \"kind\": \"model\","
            grep -qF "$head$rk \"size\"" "$three/checkpoint.json" ||
                fail "$three: shard $k is not rank $r's"
        done
        grep -q '{"name": "model.safetensors.index.json", "kind": "model", "size"' \
            "$three/checkpoint.json" || fail "$three: the index is not rank 0's"
        run_rc 0 "$CKPT_BIN" inspect "$three"
    fi
    run_rc 0 "$CKPT_BIN" verify "$WORK/$layout-3"
    # (the generators of ranks 1 and 2 are the only files one process lacks)
    run_rc 1 "$CKPT_BIN" diff "$one" "$three"
    if grep -vE '^random_states_[12]\.safetensors: only in B$|num_processes: 1 vs 3|^2 differences$' \
        "$WORK/out"; then
        fail "$layout: what 1 and 3 processes saved differs"
    fi
    if [ "$layout" != sharded ]; then
        run_rc 0 "$CKPT_BIN" export "$three" "$WORK/exp3"
        run_rc 0 "$CKPT_BIN" export "$one" "$WORK/exp1"
        run_rc 0 "$CKPT_BIN" diff "$WORK/exp1/model.safetensors" "$WORK/exp3/model.safetensors"
        PYTHONPATH="$CKPT_SOURCE_DIR/python" "${CKPT_PYTHON:-python3}" -B -c '
import sys, numpy as np, ckpt_torch
a = ckpt_torch.load(sys.argv[1], as_torch=False)["files"]
b = ckpt_torch.load(sys.argv[2], as_torch=False)["files"]
for f in ("model", "optimizer"):
    assert sorted(a[f]) == sorted(b[f]), (f, sorted(a[f]), sorted(b[f]))
    for k in a[f]:
        x, y = a[f][k], b[f][k]
        assert (np.array_equal(x, y) and x.dtype == y.dtype) if isinstance(x, np.ndarray) else x == y, k
' "$one" "$three" || fail "ckpt_torch reads the 3-process $layout checkpoint otherwise"
        rm -rf "$WORK/exp1" "$WORK/exp3"
    fi
    rm -rf "${WORK:?}/$layout-1" "${WORK:?}/$layout-3"
done
[ -z "$LAYOUTS" ] || echo "PASS ($LAYOUTS): every rank saved and loaded at most 1.25 x state/P + 1 MiB"

# ---- reshard P -> Q, ZeRO-1 on or off on each side; format version 1 --------
# tests/progs/mpi/reshard_check.c: a model with AdamW (ZeRO-1 unless
# CKPT_TEST_ZERO=0) and a row-sharded custom object, saved on P ranks and
# loaded on Q; the loaded values, and one more optimizer step, equal bit for
# bit a job that never saved.
# Each pair saves twice and loads each save once: ZeRO-1 the same on both
# sides (on-on, off-off) for 1:3, 4:2 and 4:1, different (on-off, off-on)
# for 2:4 and 3:2, so each half of the suite's reshard tests (up, down)
# covers every pairing of the sides.
CHECK=$CKPT_BUILD_DIR/tests/reshard_check
for pq in $PAIRS; do
    p=${pq%:*} q=${pq#*:}
    case "$pq" in 1:3 | 4:2 | 4:1) combos="1:1 0:0" ;; *) combos="1:0 0:1" ;; esac
    for zz in $combos; do
        zs=${zz%:*} zl=${zz#*:}
        d=$WORK/rs-$p-$q-$zs
        CKPT_TEST_ZERO=$zs run_rc 0 mpirun --oversubscribe -np "$p" "$CHECK" save "$d"
        CKPT_TEST_ZERO=$zl run_rc 0 mpirun --oversubscribe -np "$q" "$CHECK" check "$d"
        rm -rf "$d"
    done
done
[ -z "$PAIRS" ] || echo "ok: reshard $PAIRS (P:Q), ZeRO-1 on and off on each side"
[ "${CKPT_IO_SHARE_V1:-1}" = 1 ] || exit 0
# A checkpoint of format version 1, saved on 3 ranks by the library before
# the save plan, loads on 3, 2, 1 and 4 ranks, and ckpt_torch reads it.
for q in 3 2 1 4; do
    d=$WORK/v1-$q
    mkdir -p "$d/checkpoints"
    cp -r "$CKPT_SOURCE_DIR/tests/fixtures/v1-3proc/checkpoint_0" "$d/checkpoints/"
    grep -q '"format_version": 1' "$d/checkpoints/checkpoint_0/checkpoint.json" ||
        fail "the fixture is not format version 1"
    run_rc 0 mpirun --oversubscribe -np "$q" "$CHECK" check "$d"
done
run_rc 0 "$CKPT_BIN" verify "$WORK/v1-3"
PYTHONPATH="$CKPT_SOURCE_DIR/python" "${CKPT_PYTHON:-python3}" -B -c '
import sys, numpy as np, ckpt_torch
f = ckpt_torch.load(sys.argv[1], as_torch=False)["files"]
rows = f["custom_checkpoint_0"]["rows"]
assert rows.shape == (7, 2) and (rows.ravel() == 3 + np.arange(14, dtype=np.float32)).all(), rows
assert f["model"]["a"].shape == (5, 3)
' "$WORK/v1-3/checkpoints/checkpoint_0" || fail "ckpt_torch does not read the version 1 fixture"
echo "ok: the format version 1 fixture loads on 3, 2, 1 and 4 ranks"
