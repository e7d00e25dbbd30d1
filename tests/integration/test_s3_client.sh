#!/usr/bin/env bash
# The object-store client (src/store/s3) against a real S3-compatible server
# on loopback (s3rver behind the test proxy, which checks every Signature V4
# and injects faults): PUT, conditional PUT, multipart upload in parallel
# parts, parallel ranged GET hashed in order, ListObjectsV2 pages, HEAD,
# DELETE; retries of 5xx storms, dropped and cut connections and stalled
# answers; clear errors naming the key for 403, 404, a size that is not the
# expected one and a storm longer than the retries.
source "$(dirname "$0")/common.bash"
source "$(dirname "$0")/s3_common.bash"
s3_start
export CKPT_S3_PART_SIZE=1M CKPT_S3_CONNECTIONS=4

head -c 5000000 /dev/urandom >"$WORK/big"
echo hello >"$WORK/small"
T=$S3_TOOL

# PUT, then a conditional PUT of the same key: CKPT_EEXIST, nothing replaced
run_rc 0 "$T" put ckpt-test run/small "$WORK/small" absent
echo other >"$WORK/other"
run_rc 1 "$T" put ckpt-test run/small "$WORK/other" absent
has "CKPT_EEXIST" <"$WORK/err" || fail "a second If-None-Match PUT: $(cat "$WORK/err")"
has "s3://ckpt-test/run/small" <"$WORK/err" || fail "the 412 does not name the key"
run_rc 0 "$T" cat ckpt-test run/small
has "^hello" <"$WORK/out" || fail "a conditional PUT that lost replaced the object"

# a streamed multipart upload (writes not aligned to parts), a parallel GET
run_rc 0 "$T" upload ckpt-test run/big "$WORK/big" 777777
[ "$(s3_stat POST)" -ge 2 ] || fail "no multipart upload was made: $(s3_stats)"
run_rc 0 "$T" get ckpt-test run/big 5000000 "$WORK/big.out"
cmp -s "$WORK/big" "$WORK/big.out" || fail "the object read back differs"
# the digest is of the bytes kept
read -r _ h1 _ _ _ < <(grep xxh3 "$WORK/out")
grep -q "of the bytes kept: ${h1})" "$WORK/out" || fail "digest of other bytes: $(cat "$WORK/out")"
# signed payloads (every part's SHA-256, checked by the proxy)
CKPT_S3_SIGN_PAYLOAD=1 run_rc 0 "$T" upload ckpt-test run/big.signed "$WORK/big"

# a size that is not the one expected: refused after a HEAD, nothing read
s3_reset
run_rc 1 "$T" get ckpt-test run/big 4999999 "$WORK/x"
has "CKPT_ECORRUPT" <"$WORK/err" && has "holds 5000000 bytes, expected 4999999" <"$WORK/err" ||
    fail "wrong size: $(cat "$WORK/err")"
[ "$(s3_stat GET)" = 0 ] || fail "a GET was made for an object of the wrong size"

# several objects' ranges at once, no HEAD: each response checked against the
# size the caller expects (from a listing), the digest of the bytes kept
s3_reset
run_rc 0 "$T" getmany ckpt-test run/big 5000000 run/small 6
[ "$(s3_stat req_head)" = 0 ] || fail "getmany made a HEAD: $(s3_stats)"
[ "$(s3_stat req_get)" = 6 ] || fail "getmany: 5 ranges and 1 GET expected: $(s3_stats)"
grep -q "^run/big xxh3 $h1 (of the bytes kept: $h1)" "$WORK/out" || fail "getmany: $(cat "$WORK/out")"
run_rc 1 "$T" getmany ckpt-test run/small 6 run/big 4999999
has "CKPT_ECORRUPT" <"$WORK/err" && has "s3://ckpt-test/run/big" <"$WORK/err" ||
    fail "getmany of a wrong size: $(cat "$WORK/err")"
grep -q "^failed 1" "$WORK/out" || fail "getmany names the failing object: $(cat "$WORK/out")"

# server-side copies: CopyObject, only if the source's ETag is still the one
# given; a larger object by UploadPartCopy ranges (the proxy does those)
etag=$("$T" head ckpt-test run/big | sed -n 's/^size 5000000 etag \([^ ]*\) .*/\1/p')
[ -n "$etag" ] || fail "no ETag for run/big"
s3_reset
run_rc 0 "$T" copy ckpt-test run/big run/big.copy 5000000 "$etag"
[ "$(s3_stat req_copy)" = 1 ] && [ "$(s3_stat bytes_in)" = 0 ] ||
    fail "a copy moved bytes through the client: $(s3_stats)"
run_rc 0 "$T" get ckpt-test run/big.copy 5000000 "$WORK/copy.out"
cmp -s "$WORK/big" "$WORK/copy.out" || fail "the copy differs"
run_rc 1 "$T" copy ckpt-test run/big run/big.copy2 5000000 '"0123456789abcdef0123456789abcdef"'
has "CKPT_EEXIST" <"$WORK/err" || fail "a copy whose source changed: $(cat "$WORK/err")"
run_rc 1 "$T" head ckpt-test run/big.copy2
s3_reset
CKPT_S3_COPY_MAX=2M run_rc 0 "$T" copy ckpt-test run/big run/big.parts 5000000 "$etag"
[ "$(s3_stat req_part_copy)" = 3 ] && [ "$(s3_stat req_complete)" = 1 ] ||
    fail "a copy over CKPT_S3_COPY_MAX: $(s3_stats)"
run_rc 0 "$T" get ckpt-test run/big.parts 5000000 "$WORK/copy.out"
cmp -s "$WORK/big" "$WORK/copy.out" || fail "the copy in parts differs"
for k in run/big.copy run/big.parts; do run_rc 0 "$T" delete ckpt-test "$k"; done

# ListObjectsV2, one key per page: every key once, prefixes with a delimiter
S3_TOOL_LIST_PAGE=1 run_rc 0 "$T" list ckpt-test run/
[ "$(grep -c '^key ' "$WORK/out")" = 3 ] || fail "paged listing: $(cat "$WORK/out")"
grep -q "^key run/big 5000000$" "$WORK/out" || fail "listing sizes: $(cat "$WORK/out")"
run_rc 0 "$T" list ckpt-test "" /
grep -q "^prefix run/ 0$" "$WORK/out" || fail "delimiter listing: $(cat "$WORK/out")"

# 404 and 403 name the key and are not retried
run_rc 1 "$T" head ckpt-test run/nothing
has "CKPT_ENOENT" <"$WORK/err" && has "s3://ckpt-test/run/nothing" <"$WORK/err" ||
    fail "404: $(cat "$WORK/err")"
AWS_SECRET_ACCESS_KEY=wrong run_rc 1 "$T" cat ckpt-test run/small
has "access denied (HTTP 403)" <"$WORK/err" && has "s3://ckpt-test/run/small" <"$WORK/err" &&
    has "AWS_SECRET_ACCESS_KEY" <"$WORK/err" || fail "403: $(cat "$WORK/err")"
grep -q "retries=0" "$WORK/out" || fail "a 403 was retried"
AWS_ACCESS_KEY_ID=nobody run_rc 1 "$T" put ckpt-test run/x "$WORK/small"
has "InvalidAccessKeyId" <"$WORK/err" || fail "unknown key: $(cat "$WORK/err")"

# a storm of 503s shorter than the retries: retried, then done
s3_faults '[{"method":"PUT","action":"status","status":503,"count":3}]'
run_rc 0 "$T" put ckpt-test run/storm "$WORK/small"
grep -q "retries=3" "$WORK/out" || fail "503 storm: $(cat "$WORK/out")"
# longer than the retries: a clear failure naming the key
s3_faults '[{"method":"PUT","action":"status","status":500}]'
CKPT_S3_RETRIES=2 run_rc 1 "$T" put ckpt-test run/storm "$WORK/small"
has "s3://ckpt-test/run/storm: PUT: HTTP 500" <"$WORK/err" && has "after retries" <"$WORK/err" ||
    fail "endless 500s: $(cat "$WORK/err")"
# parts that fail for good: the upload fails and is aborted on the server
s3_reset
s3_faults '[{"method":"PUT","query":"partNumber=3","action":"status","status":503}]'
CKPT_S3_RETRIES=1 run_rc 1 "$T" upload ckpt-test run/failed "$WORK/big"
has "upload of part 3" <"$WORK/err" || fail "failed part: $(cat "$WORK/err")"
[ "$(s3_stat abort_multipart)" = 1 ] || fail "the failed upload was not aborted: $(s3_stats)"
run_rc 1 "$T" head ckpt-test run/failed

# dropped connections, answers cut half-way, a stalled server: retried
s3_faults '[{"method":"GET","action":"drop","count":2},{"method":"GET","action":"cut","count":2,"after":1}]'
run_rc 0 "$T" get ckpt-test run/big 5000000 "$WORK/big.out"
cmp -s "$WORK/big" "$WORK/big.out" || fail "read back after drops and cuts differs"
[ "$(s3_stat fault_drop)" = 2 ] && [ "$(s3_stat fault_cut)" = 2 ] || fail "faults: $(s3_stats)"
s3_faults '[{"method":"HEAD","action":"slow","delay_ms":4000,"count":1}]'
CKPT_S3_TIMEOUT=1 run_rc 0 "$T" head ckpt-test run/big
grep -q "retries=1" "$WORK/out" || fail "a stalled answer was not retried: $(cat "$WORK/out")"
s3_reset

# a flipped byte in the stored object: the digest of what arrives differs
f=$(s3_file run/big)
[ -f "$f" ] || fail "no s3rver file for run/big ($f)"
python3 - "$f" <<'PY'
import sys
p = sys.argv[1]
b = bytearray(open(p, 'rb').read()); b[3333333] ^= 1; open(p, 'wb').write(b)
PY
run_rc 0 "$T" get ckpt-test run/big 5000000 "$WORK/big.out"
grep -q "xxh3 $h1 " "$WORK/out" && fail "a flipped byte gave the same digest"

# DELETE
run_rc 0 "$T" delete ckpt-test run/small
run_rc 1 "$T" head ckpt-test run/small
echo "s3 client: ok"
