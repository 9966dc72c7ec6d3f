# Thin wrapper over scripts/. Each target installs missing Debian packages first.
PYTHON ?= /usr/bin/python3
BUILD_DIR ?= build
export PYTHON BUILD_DIR

.PHONY: all build test test-deploy demo demo-sync bench fuzz clean
all: build
build:
	scripts/build.sh
test:
	scripts/test.sh
# The images built and the compose test stack run, with Docker (scripts/test_deploy.sh; root, or
# a running Docker engine).
test-deploy:
	scripts/test_deploy.sh
demo:
	scripts/demo.sh
demo-sync:
	scripts/demo_sync.sh
bench:
	scripts/bench.sh
# Long fuzz runs (tests/fuzz/README.md): each target for FUZZ_SECONDS, 600 by default; FUZZ_MERGE=1
# adds what they found to tests/fuzz/corpus/.
fuzz:
	FUZZ_SECONDS=$(or $(FUZZ_SECONDS),600) scripts/fuzz.sh
clean:
	rm -rf $(BUILD_DIR)
