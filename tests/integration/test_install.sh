#!/usr/bin/env bash
# test_install.sh — proves `make install` gives users a working library: a
# separate Release build is installed into a temporary prefix (with
# `cmake --install --prefix`, so nothing may depend on the configure-time
# prefix), then a small program that saves and reloads a model is built
# against it three ways: pkg-config + shared library, pkg-config --static
# (fully static binary), and a CMake project using find_package(ckpt).
# Also checks that libckpt.so exports nothing but the public ckpt_* API and
# that no internal header is installed. With MPI: libckpt_mpi is installed
# too, an MPI program is built against it (pkg-config ckpt_mpi, CMake
# ckpt::ckpt_mpi) and run on two processes, and libckpt itself has no MPI in
# it (ldd, nm).
source "$(dirname "$0")/common.bash" # $WORK, fail, has

: "${CKPT_SOURCE_DIR:?set CKPT_SOURCE_DIR to the source folder}"
CC=${CC:-cc}
JOBS=$(nproc 2>/dev/null || echo 2)
BUILD=$WORK/build
PREFIX=$WORK/prefix

# run LOG CMD...: runs CMD with its output in $WORK/LOG, shown only on failure.
run() {
    local log=$WORK/$1 rc=0
    shift
    "$@" >"$log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        cat "$log" >&2
        fail "exit $rc: $*"
    fi
}

# --- a separate Release build, installed elsewhere than configured -----------
run configure.log cmake -S "$CKPT_SOURCE_DIR" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DCKPT_BUILD_TESTS=OFF -DCKPT_SANITIZE=OFF -DCMAKE_INSTALL_PREFIX=/nonexistent/ckpt-prefix
HAVE_MPI=${CKPT_HAVE_MPI:-0}
targets=(ckpt ckpt_static ckpt_cli)
[ "$HAVE_MPI" = 1 ] && targets+=(ckpt_mpi ckpt_mpi_static)
run build.log cmake --build "$BUILD" -j "$JOBS" --target "${targets[@]}"
run install.log cmake --install "$BUILD" --prefix "$PREFIX"

LIBDIR=$(ls -d "$PREFIX"/lib*/ | head -n1)
LIBDIR=${LIBDIR%/}
[ -f "$PREFIX/include/ckpt.h" ] || fail "ckpt.h not installed"
extra=$(cd "$PREFIX/include" && find . -type f | sed 's|^\./||' |
        grep -vxE 'ckpt.h|ckpt_mpi.h|ckpt/(comm|files|torch)\.h' || true)
[ -z "$extra" ] || fail "internal headers installed: $extra"
for h in comm files torch; do
    [ -f "$PREFIX/include/ckpt/$h.h" ] || fail "ckpt/$h.h not installed"
done
for f in libckpt.so libckpt.a pkgconfig/ckpt.pc cmake/ckpt/ckptConfig.cmake \
         cmake/ckpt/ckptConfigVersion.cmake cmake/ckpt/ckptTargets.cmake; do
    [ -e "$LIBDIR/$f" ] || fail "$LIBDIR/$f not installed"
done
run cli.log "$PREFIX/bin/ckpt" --version
# the installed tool trains with the installed data set (share/ckpt)
[ -f "$PREFIX/share/ckpt/digits.csv.gz" ] || fail "the data set is not installed"
cmp "$PREFIX/share/ckpt/digits.csv.gz" "$CKPT_SOURCE_DIR/data/digits.csv.gz" || fail "installed data differs"
(unset CKPT_DATA; cd "$WORK" && run train.log "$PREFIX/bin/ckpt" train --epochs 1 --quiet --project-dir "$WORK/train")
grep -q "test accuracy" "$WORK/train.log" || fail "installed ckpt train did not finish: $(cat "$WORK/train.log")"
grep -q '/nonexistent/ckpt-prefix' -r "$LIBDIR/pkgconfig" "$LIBDIR/cmake" &&
    fail "installed files name the configure-time prefix, not the install prefix"

# --- only the public API is exported ------------------------------------------
nm -D --defined-only "$LIBDIR/libckpt.so" | awk '{print $NF}' >"$WORK/exports"
grep -qx 'ckpt_save_state' "$WORK/exports" || fail "ckpt_save_state is not exported"
leaked=$(grep -v '^ckpt_' "$WORK/exports" | grep -vxE '_init|_fini|_edata|_end|__bss_start' || true)
[ -z "$leaked" ] || fail "libckpt.so exports non-API symbols: $(echo $leaked)"

# --- the core library has no MPI in it -----------------------------------------
if ldd "$LIBDIR/libckpt.so" | has -i 'mpi\|open-pal\|open-rte'; then
    fail "libckpt.so depends on MPI: $(ldd "$LIBDIR/libckpt.so" | grep -i mpi)"
fi
if nm -D --undefined-only "$LIBDIR/libckpt.so" | has 'MPI_'; then
    fail "libckpt.so calls MPI"
fi
if nm "$LIBDIR/libckpt.a" 2>/dev/null | has ' U P\?MPI_'; then
    fail "libckpt.a calls MPI"
fi

# --- the user's program ------------------------------------------------------
mkdir -p "$WORK/app"
cat >"$WORK/app/app.c" <<'EOF'
/* Saves a model with an accelerator, scribbles over it, loads it back. */
#include <ckpt.h>
#include <stdio.h>
#include <string.h>

#define CHECK(call)                                                        \
    do {                                                                   \
        if ((call) < 0) {                                                  \
            fprintf(stderr, "app: %s: %s\n", #call, ckpt_errmsg());        \
            return 1;                                                      \
        }                                                                  \
    } while (0)

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    if (strcmp(ckpt_version(), CKPT_VERSION_STRING) != 0) {
        fprintf(stderr, "app: header %s, library %s\n", CKPT_VERSION_STRING, ckpt_version());
        return 1;
    }
    float w[6] = {1.5f, -2.0f, 3.25f, 0.0f, 1e-3f, 42.0f}, want[6];
    memcpy(want, w, sizeof w);
    ckpt_model *m = NULL;
    ckpt_accelerator *acc = NULL;
    CHECK(ckpt_model_new(&m));
    CHECK(ckpt_model_add_param(m, "layer.weight", CKPT_F32, 2, (int64_t[]){2, 3}, w, NULL));
    ckpt_project_config cfg = {.project_dir = argv[1]};
    CHECK(ckpt_accelerator_new(&acc, &cfg));
    CHECK(ckpt_prepare_model(acc, m));
    ckpt_accelerator_set_step(acc, 7);
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/saved", argv[1]);
    CHECK(ckpt_save_state(acc, dir));
    ckpt_checkpoint_info info;
    CHECK(ckpt_checkpoint_verify(dir, true, &info));
    memset(w, 0xff, sizeof w);
    ckpt_accelerator_set_step(acc, 0);
    CHECK(ckpt_load_state(acc, dir));
    if (memcmp(w, want, sizeof w) != 0 || ckpt_accelerator_step(acc) != 7) {
        fprintf(stderr, "app: loaded state differs from the saved one\n");
        return 1;
    }
    ckpt_accelerator_free(acc);
    ckpt_model_free(m);
    printf("ok %s\n", ckpt_version());
    return 0;
}
EOF

export PKG_CONFIG_PATH=$LIBDIR/pkgconfig
want_version=$(sed -n 's/^#define CKPT_VERSION_STRING "\(.*\)"$/\1/p' "$CKPT_SOURCE_DIR/include/ckpt.h")
[ "$(pkg-config --modversion ckpt)" = "$want_version" ] || fail "pkg-config version is not $want_version"

# run_app NAME BINARY: runs it on a fresh project folder; it must print "ok".
run_app() {
    mkdir -p "$WORK/run-$1"
    run "run-$1.log" "$2" "$WORK/run-$1"
    grep -qx "ok $want_version" "$WORK/run-$1.log" || fail "$1: unexpected output: $(cat "$WORK/run-$1.log")"
}

# (a) pkg-config, shared: the binary must load the installed libckpt.so.
# shellcheck disable=SC2046
run cc-shared.log "$CC" -std=c11 -Wall -Werror -o "$WORK/app/app_shared" "$WORK/app/app.c" \
    $(pkg-config --cflags --libs ckpt)
LD_LIBRARY_PATH=$LIBDIR ldd "$WORK/app/app_shared" | has "$LIBDIR/libckpt.so" ||
    fail "app_shared does not load $LIBDIR/libckpt.so"
LD_LIBRARY_PATH=$LIBDIR run_app shared "$WORK/app/app_shared"
# each tier header compiles on its own (it includes ckpt.h), in C and C++
for h in ckpt.h ckpt/comm.h ckpt/files.h ckpt/torch.h; do
    printf '#include <%s>\nint main(void) { return ckpt_version() == 0; }\n' "$h" >"$WORK/app/tier.c"
    # shellcheck disable=SC2046
    run tier.log "$CC" -std=c11 -Wall -Wextra -pedantic -Werror -c -o "$WORK/app/tier.o" \
        "$WORK/app/tier.c" $(pkg-config --cflags ckpt)
    if command -v c++ >/dev/null; then
        # shellcheck disable=SC2046
        run tier.log c++ -x c++ -Wall -Werror -c -o "$WORK/app/tier.o" "$WORK/app/tier.c" \
            $(pkg-config --cflags ckpt)
    fi
done

# (a) pkg-config --static: everything, libc included, in one binary, so
# Requires.private / Libs.private must name every dependency. With object
# storage the library needs libcurl, whose own dependencies (nghttp2, idn2,
# ssh2, gssapi, ldap...) Debian ships without static archives: a fully
# static binary cannot be linked there. The .pc must still name libcurl and
# libcrypto; the static library itself is linked in (b).
if pkg-config --print-requires-private ckpt | has libcurl; then
    pkg-config --print-requires-private ckpt | has libcrypto ||
        fail "ckpt.pc names libcurl but not libcrypto"
    echo "pkg-config --static: skipped the fully static binary (libcurl's dependencies have no static archives on Debian)"
else
    # shellcheck disable=SC2046
    run cc-static.log "$CC" -std=c11 -Wall -Werror -static -o "$WORK/app/app_static" "$WORK/app/app.c" \
        $(pkg-config --static --cflags --libs ckpt)
    if readelf -d "$WORK/app/app_static" | has NEEDED; then
        fail "app_static is not static: $(readelf -d "$WORK/app/app_static" | grep NEEDED)"
    fi
    run_app static "$WORK/app/app_static"
fi

# (b) CMake: find_package(ckpt) and the exported targets.
mkdir -p "$WORK/cmake-app"
cat >"$WORK/cmake-app/CMakeLists.txt" <<EOF
cmake_minimum_required(VERSION 3.16)
project(ckpt_user C)
find_package(ckpt $want_version REQUIRED)
add_executable(app_cmake "$WORK/app/app.c")
target_link_libraries(app_cmake PRIVATE ckpt::ckpt)
add_executable(app_cmake_static "$WORK/app/app.c")
target_link_libraries(app_cmake_static PRIVATE ckpt::ckpt_static)
EOF
unset PKG_CONFIG_PATH
run cmake-app-configure.log cmake -S "$WORK/cmake-app" -B "$WORK/cmake-app/build" \
    -DCMAKE_PREFIX_PATH="$PREFIX" -DCMAKE_BUILD_TYPE=Release
run cmake-app-build.log cmake --build "$WORK/cmake-app/build" -j "$JOBS"
LD_LIBRARY_PATH=$LIBDIR run_app cmake "$WORK/cmake-app/build/app_cmake"
if ldd "$WORK/cmake-app/build/app_cmake_static" | has libckpt.so; then
    fail "app_cmake_static links libckpt.so"
fi
run_app cmake-static "$WORK/cmake-app/build/app_cmake_static"

# --- an MPI program: libckpt_mpi ------------------------------------------------
if [ "$HAVE_MPI" = 1 ]; then
    for f in libckpt_mpi.so libckpt_mpi.a pkgconfig/ckpt_mpi.pc cmake/ckpt/ckptMpiTargets.cmake; do
        [ -e "$LIBDIR/$f" ] || fail "$LIBDIR/$f not installed"
    done
    [ -f "$PREFIX/include/ckpt_mpi.h" ] || fail "ckpt_mpi.h not installed"
    nm -D --defined-only "$LIBDIR/libckpt_mpi.so" | awk '{print $NF}' >"$WORK/mpi_exports"
    leaked=$(grep -vx 'ckpt_comm_mpi' "$WORK/mpi_exports" | grep -vxE '_init|_fini|_edata|_end|__bss_start' || true)
    [ -z "$leaked" ] || fail "libckpt_mpi.so exports more than ckpt_comm_mpi: $(echo $leaked)"
    cat >"$WORK/app/app_mpi.c" <<'EOF'
/* Every rank saves one collective checkpoint (the model once, a random
 * state each), loads it back, and rank 0 says ok. */
#include <ckpt_mpi.h>
#include <stdio.h>
#include <string.h>

#define CHECK(call)                                                        \
    do {                                                                   \
        if ((call) < 0) {                                                  \
            fprintf(stderr, "app_mpi: %s: %s\n", #call, ckpt_errmsg());    \
            MPI_Abort(MPI_COMM_WORLD, 1);                                  \
        }                                                                  \
    } while (0)

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    ckpt_comm *comm = NULL;
    CHECK(ckpt_comm_mpi(&comm, MPI_COMM_WORLD));
    float w[4] = {1, 2, 3, 4};
    ckpt_model *m = NULL;
    ckpt_accelerator *acc = NULL;
    CHECK(ckpt_model_new(&m));
    CHECK(ckpt_model_add_param(m, "w", CKPT_F32, 1, (int64_t[]){4}, w, NULL));
    ckpt_project_config cfg = {.project_dir = argv[1], .automatic_checkpoint_naming = true,
                               .comm = comm};
    CHECK(ckpt_accelerator_new(&acc, &cfg));
    CHECK(ckpt_prepare_model(acc, m));
    CHECK(ckpt_save_state(acc, NULL));
    memset(w, 0, sizeof w);
    CHECK(ckpt_load_state(acc, NULL));
    int ok = w[3] == 4 && ckpt_accelerator_num_processes(acc) == comm->size;
    if (comm->rank == 0) printf(ok ? "ok %d\n" : "bad %d\n", comm->size);
    ckpt_accelerator_free(acc);
    ckpt_model_free(m);
    ckpt_comm_free(comm);
    MPI_Finalize();
    return ok ? 0 : 1;
}
EOF
    export PKG_CONFIG_PATH=$LIBDIR/pkgconfig
    # shellcheck disable=SC2046
    run cc-mpi.log "$CC" -std=c11 -Wall -Werror -o "$WORK/app/app_mpi" "$WORK/app/app_mpi.c" \
        $(pkg-config --cflags --libs ckpt_mpi)
    unset PKG_CONFIG_PATH
    mkdir -p "$WORK/cmake-mpi"
    cat >"$WORK/cmake-mpi/CMakeLists.txt" <<EOF
cmake_minimum_required(VERSION 3.16)
project(ckpt_mpi_user C)
find_package(ckpt $want_version REQUIRED)
add_executable(app_mpi_cmake "$WORK/app/app_mpi.c")
target_link_libraries(app_mpi_cmake PRIVATE ckpt::ckpt_mpi)
EOF
    run cmake-mpi-configure.log cmake -S "$WORK/cmake-mpi" -B "$WORK/cmake-mpi/build" \
        -DCMAKE_PREFIX_PATH="$PREFIX" -DCMAKE_BUILD_TYPE=Release
    run cmake-mpi-build.log cmake --build "$WORK/cmake-mpi/build" -j "$JOBS"
    if command -v mpirun >/dev/null 2>&1; then
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
        export OMPI_MCA_btl=self,vader OMPI_MCA_pml=ob1 OMPI_MCA_mpi_yield_when_idle=1
        for app in "$WORK/app/app_mpi" "$WORK/cmake-mpi/build/app_mpi_cmake"; do
            proj=$WORK/mpi-$(basename "$app")
            LD_LIBRARY_PATH=$LIBDIR run mpi-run.log mpirun --oversubscribe -np 2 "$app" "$proj"
            grep -qx "ok 2" "$WORK/mpi-run.log" || fail "$app: $(cat "$WORK/mpi-run.log")"
            ls "$proj/checkpoints/checkpoint_0" | has random_states_1.safetensors ||
                fail "$app: rank 1 wrote no random state"
        done
    fi
    echo "install: libckpt_mpi built against with pkg-config and CMake, ran on 2 processes"
fi

echo "install: shared, static and CMake consumers built and ran against $PREFIX"
