#!/usr/bin/env bash
# scripts/setup waits for another apt or dpkg that holds the package locks
# (unattended-upgrades, a second setup) instead of failing at once: every
# apt-get it runs is given DPkg::Lock::Timeout. Stand-ins for dpkg-query (all
# packages missing), id (root) and apt-get (it fails as the real one does
# when a lock is held and no timeout is given, else waits and succeeds), so
# this changes nothing on the machine and takes no time.
source "$(dirname "$0")/common.bash"

stubs=$WORK/bin
mkdir -p "$stubs"
cat >"$stubs/dpkg-query" <<'SH'
#!/usr/bin/env bash
exit 1
SH
cat >"$stubs/id" <<'SH'
#!/usr/bin/env bash
echo 0
SH
cat >"$stubs/apt-get" <<SH
#!/usr/bin/env bash
echo "apt-get \$*" >>"$WORK/calls"
case " \$* " in
*" DPkg::Lock::Timeout="[1-9]*) sleep 0.1; exit 0 ;; # waited for the holder
esac
if [ -e "$WORK/lock-held" ]; then
    echo "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 4242 (apt-get)" >&2
    exit 100
fi
SH
chmod +x "$stubs"/*
touch "$WORK/lock-held"
PATH=$stubs:$PATH run_rc 0 bash "${CKPT_SOURCE_DIR:?set CKPT_SOURCE_DIR}/scripts/setup" build
has "waiting, up to 600 s, for any other apt or dpkg" <"$WORK/out" || fail "no word of the wait: $(cat "$WORK/out")"
[ "$(grep -c . "$WORK/calls")" -eq 2 ] || fail "expected apt-get update and install: $(cat "$WORK/calls")"
while read -r call; do
    has "DPkg::Lock::Timeout=600 " <<<"$call" || fail "an apt-get without the lock timeout: $call"
done <"$WORK/calls"
rm -f "$WORK/calls"
CKPT_APT_LOCK_TIMEOUT=5 PATH=$stubs:$PATH run_rc 0 bash "$CKPT_SOURCE_DIR/scripts/setup" build
grep -q "DPkg::Lock::Timeout=5 install" "$WORK/calls" || fail "CKPT_APT_LOCK_TIMEOUT not used"
echo "ok: scripts/setup waits for the package locks"
