# Thin wrapper over CMake for the README's commands.
#   make          release build (build/)
#   make test     sanitizer build (build-test/) and every test
#   make check    sanitizer build and the quick tests (label quick): a few minutes
#   make demo     the main job: train, kill -9, resume, compare
#   make bench    benchmarks (bench/README.md)
#   make memflat  1,000 async/sync saves and loads of a ~100 MB state: memory stays flat
#   make tsan     ThreadSanitizer build (build-tsan/) and the threaded tests
#   make valgrind unit tests and a CLI run under valgrind memcheck (build-valgrind/)
#   make install  install into PREFIX (default /usr/local)
#   make format-check  C lines changed since BASE (default HEAD) follow .clang-format
PREFIX ?= /usr/local
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE ?= cmake
# cmake --build runs make again below this one: without this, every line of
# the build would come wrapped in "Entering/Leaving directory" messages.
MAKEFLAGS += --no-print-directory

.PHONY: all setup build build-test test check demo bench memflat install clean fuzz tsan valgrind format-check

all: build

setup:
	@bash scripts/setup all

build:
	@bash scripts/setup build
	@$(CMAKE) -S . -B build -DCMAKE_BUILD_TYPE=Release -DCKPT_BUILD_TESTS=OFF -DCMAKE_INSTALL_PREFIX=$(PREFIX) >/dev/null
	@$(CMAKE) --build build -j $(JOBS)

build-test:
	@bash scripts/setup test
	@$(CMAKE) -S . -B build-test -DCMAKE_BUILD_TYPE=Debug -DCKPT_SANITIZE=ON >/dev/null
	@$(CMAKE) --build build-test -j $(JOBS)
	@bash scripts/setup s3rver build-test/s3rver

test: build-test
	@cd build-test && ctest --output-on-failure -j $(JOBS)

# The quick loop while changing code: the unit tests, the fuzz corpora and
# the integration tests that take seconds (tests/CMakeLists.txt labels them
# quick); `make test` before a pull request.
check: build-test
	@cd build-test && ctest --output-on-failure -j $(JOBS) -L quick

demo: build
	@bash scripts/setup demo
	@bash scripts/demo build

bench: build
	@bash scripts/setup all
	@bash bench/run build

# Host memory over 1,000 saves and loads of a ~100 MB state (counts bytes, times
# nothing; 3,000 operations: minutes to most of an hour on a busy machine).
# MEMFLAT_DIR: where the checkpoints go (a tmpfs folder spares the disk).
MEMFLAT_DIR ?= build
memflat: build
	@./build/bench_memflat $(MEMFLAT_DIR) 100 1000

# The tests that run threads (background saves, thread ranks, loader workers,
# a preemption signal landing on another thread).
tsan:
	@bash scripts/setup test
	@$(CMAKE) -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DCKPT_TSAN=ON >/dev/null
	@$(CMAKE) --build build-tsan -j $(JOBS)
	@cd build-tsan && ctest --output-on-failure -j $(JOBS) -R 'unit\.test_(async|collective|dataloader|flexload|hashread|io|onepass|policy)$$'

install: build
	@$(CMAKE) --install build --prefix $(PREFIX)

fuzz:
	@bash scripts/setup test
	@$(CMAKE) -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=Debug -DCKPT_FUZZ=ON >/dev/null
	@$(CMAKE) --build build-fuzz -j $(JOBS)

valgrind:
	@bash scripts/setup valgrind
	@$(CMAKE) -S . -B build-valgrind -DCMAKE_BUILD_TYPE=Debug -DCKPT_SANITIZE=OFF >/dev/null
	@$(CMAKE) --build build-valgrind -j $(JOBS)
	@bash scripts/valgrind build-valgrind

BASE ?= HEAD
format-check:
	@bash scripts/setup format
	@bash scripts/format-check $(BASE)

clean:
	rm -rf build build-test build-fuzz build-tsan build-valgrind
