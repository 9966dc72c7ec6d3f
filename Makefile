# Thin wrapper over scripts/. Each target installs missing Debian packages first.
PYTHON ?= /usr/bin/python3
BUILD_DIR ?= build
export PYTHON BUILD_DIR

.PHONY: all build test demo demo-sync bench clean
all: build
build:
	scripts/build.sh
test:
	scripts/test.sh
demo:
	scripts/demo.sh
demo-sync:
	scripts/demo_sync.sh
bench:
	scripts/bench.sh
clean:
	rm -rf $(BUILD_DIR)
