#!/usr/bin/python3
"""Checks the layers' include roots (CMakeLists.txt, "Includes"): each layer's code compiles
with the headers it may include and not with those of the layers above it.

For each layer, a probe source that includes one header is compiled with the command of a real
translation unit of that layer (from the build's compile_commands.json, with -fsyntax-only):
an allowed header must compile, a forbidden one must fail as not found itself (not for a header
it includes). So a layer whose
CMake target gains the whole tree's include path (or another layer's root) fails this test.

Usage: check_include_roots.py BUILD_DIR SOURCE_DIR
"""

import json
import os
import shlex
import subprocess
import sys
import tempfile

# layer: (a translation unit of the layer, headers it may include, headers it may not)
LAYERS = {
    "common": ("common/dtype_names.cc",
               ["common/file_io.h"],
               ["kernels/adamw_math.h", "server/schema/hyperparameters.h", "client/wire.h"]),
    "kernels": ("kernels/backend.cc",
                ["common/half_float.h", "kernels/adamw_math.h"],
                ["server/schema/hyperparameters.h", "server/engine/update_engine.h",
                 "client/wire.h", "fusedps/client.h"]),
    "server": ("server/schema/hyperparameters.cc",
               ["common/file_io.h", "kernels/adamw_math.h", "server/engine/update_engine.h"],
               ["client/wire.h", "fusedps/client.h", "bench/workloads.h"]),
    "client": ("client/wire.cc",
               ["common/half_float.h", "client/wire.h", "fusedps/client.h"],
               ["kernels/adamw_math.h", "server/schema/hyperparameters.h"]),
}


def command_of(commands, source_dir, unit):
    path = os.path.join(source_dir, unit)
    for entry in commands:
        if os.path.realpath(entry["file"]) == os.path.realpath(path):
            args = entry.get("arguments") or shlex.split(entry["command"])
            return args, entry["directory"]
    raise SystemExit(f"{unit} is not in compile_commands.json")


def probe(args, directory, unit_path, header):
    """Compiles `#include "header"` with the unit's command; returns (ok, compiler output)."""
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "probe.cc")
        with open(source, "w") as f:
            f.write(f'#include "{header}"\n')
        out = []
        skip = False
        for a in args:
            if skip:
                skip = False
                continue
            if a in ("-o", "-MF", "-MT", "-MQ"):
                skip = True
                continue
            if a in ("-c", "-MD", "-MMD"):
                continue
            if os.path.realpath(os.path.join(directory, a)) == os.path.realpath(unit_path):
                continue
            out.append(a)
        # ccache is a launcher, not the compiler: run the compiler itself.
        if os.path.basename(out[0]) == "ccache":
            out = out[1:]
        result = subprocess.run(out + ["-fsyntax-only", source], cwd=directory,
                                capture_output=True, text=True)
        return result.returncode == 0, result.stderr


def main():
    build_dir, source_dir = sys.argv[1], sys.argv[2]
    with open(os.path.join(build_dir, "compile_commands.json")) as f:
        commands = json.load(f)
    failures = []
    for layer, (unit, allowed, forbidden) in LAYERS.items():
        args, directory = command_of(commands, source_dir, unit)
        unit_path = os.path.join(source_dir, unit)
        for header in allowed:
            ok, err = probe(args, directory, unit_path, header)
            print(f"{layer}: {header}: {'compiles' if ok else 'does not compile'} (may)")
            if not ok:
                failures.append(f"{layer} may include {header}, but:\n{err[:2000]}")
        for header in forbidden:
            ok, err = probe(args, directory, unit_path, header)
            print(f"{layer}: {header}: {'compiles' if ok else 'does not compile'} (may not)")
            if ok:
                failures.append(f"{layer} may not include {header}, but it compiles")
            elif f"{header}: No such file" not in err:
                # Not found itself: a header it includes missing (a generated one) would hide
                # that the forbidden header was reachable.
                failures.append(f"{layer}: {header} failed for another reason:\n{err[:2000]}")
    if failures:
        print("\n".join(["FAILED:"] + failures))
        return 1
    print("every layer's include roots hold")
    return 0


if __name__ == "__main__":
    sys.exit(main())
