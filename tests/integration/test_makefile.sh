#!/usr/bin/env bash
# The Makefile's sub-makes (cmake --build runs make) print no
# "Entering/Leaving directory" lines. A stand-in for cmake runs a sub-make
# instead of building, so this takes no time.
source "$(dirname "$0")/common.bash"

cat >"$WORK/sub.mk" <<'MK'
all:
	@echo sub-make ran
MK
cat >"$WORK/cmake" <<SH
#!/usr/bin/env bash
case " \$* " in *" --build "*) exec make -f "$WORK/sub.mk" ;; esac
SH
chmod +x "$WORK/cmake"
unset MAKEFLAGS MFLAGS MAKELEVEL
cd "${CKPT_SOURCE_DIR:?set CKPT_SOURCE_DIR}"
run_rc 0 make build CMAKE="$WORK/cmake"
has "^sub-make ran\$" <"$WORK/out" || fail "the stand-in sub-make did not run: $(cat "$WORK/out" "$WORK/err")"
if has "directory" < <(cat "$WORK/out" "$WORK/err"); then
    fail "directory messages: $(cat "$WORK/out" "$WORK/err")"
fi
echo "ok: no Entering/Leaving directory lines"
