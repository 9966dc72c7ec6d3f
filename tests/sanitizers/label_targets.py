#!/usr/bin/env python3
"""Prints the build targets that the tests with a label need, one per line.

    label_targets.py BUILD_DIR LABEL_REGEX     e.g.  label_targets.py build-asan 'unit|integration'

A test needs a target when its command or its ENVIRONMENT names one of the target's
artifacts (its executable or library), alone or after '=' (--server=PATH, FUSEDPS_SERVER=PATH),
so a test added with a label is picked up without editing any list. (Custom targets have no
artifacts: a test that needs one, e.g. the Python stubs, needs a full build.)

The tree must be configured. The first call adds a CMake file-API query and re-runs cmake
there, so that CMake writes the map from targets to artifacts. Exits 1 when no test has the
label.
"""
import json
import os
import re
import subprocess
import sys


def codemodel_artifacts(build_dir):
    """{absolute artifact path: target name}, from CMake's file API (codemodel-v2)."""
    api = os.path.join(build_dir, ".cmake", "api", "v1")
    query = os.path.join(api, "query", "codemodel-v2")
    reply = os.path.join(api, "reply")
    if not os.path.exists(query) or not os.path.isdir(reply):
        os.makedirs(os.path.dirname(query), exist_ok=True)
        open(query, "w").close()
        subprocess.run(["cmake", build_dir], check=True, stdout=subprocess.DEVNULL)
    index = max(f for f in os.listdir(reply) if f.startswith("index-"))
    with open(os.path.join(reply, index)) as f:
        objects = json.load(f)["objects"]
    codemodel = next(o for o in objects if o["kind"] == "codemodel")
    with open(os.path.join(reply, codemodel["jsonFile"])) as f:
        configuration = json.load(f)["configurations"][0]
    artifacts = {}
    for target in configuration["targets"]:
        with open(os.path.join(reply, target["jsonFile"])) as f:
            detail = json.load(f)
        for artifact in detail.get("artifacts", []):
            path = os.path.join(os.path.abspath(build_dir), artifact["path"])
            artifacts[os.path.normpath(path)] = target["name"]
    return artifacts


# A CMake argument: a bracket argument [=[...]=], a quoted one "...", or a bare word.
ARGUMENT = re.compile(r'\[(=*)\[(.*?)\]\1\]|"((?:\\.|[^"\\])*)"|([^\s()"]+)', re.S)
CALL = re.compile(r"^(add_test|set_tests_properties)\((.*)\)\s*$", re.M)


def unquote(match):
    if match.group(2) is not None:
        return match.group(2)
    if match.group(3) is not None:
        return re.sub(r"\\(.)", r"\1", match.group(3))
    return match.group(4)


def test_words(build_dir, label_regex):
    """Every command argument and environment value of the tests matching label_regex.

    ctest selects the tests by label; their commands come from the CTestTestfile.cmake files,
    since `ctest --show-only` leaves out the command of a test whose program is not built yet.
    """
    listing = subprocess.run(
        ["ctest", "--test-dir", build_dir, "-N", "-L", label_regex, "--show-only=json-v1"],
        check=True, capture_output=True, text=True).stdout
    names = {test["name"] for test in json.loads(listing)["tests"]}
    words = []
    for directory, _, files in os.walk(build_dir):
        if "CTestTestfile.cmake" not in files:
            continue
        with open(os.path.join(directory, "CTestTestfile.cmake")) as f:
            text = f.read()
        for call in CALL.finditer(text):
            args = [unquote(m) for m in ARGUMENT.finditer(call.group(2))]
            if not args or args[0] not in names:
                continue
            if call.group(1) == "add_test":
                values = args[1:]
            elif "ENVIRONMENT" in args:
                values = [args[args.index("ENVIRONMENT") + 1]]
            else:
                continue
            for value in values:  # --sink=PATH, A=PATH;B=PATH, PYTHONPATH=PATH:PATH
                words += re.split(r"[=:;]", value)
    return len(names), words


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    build_dir, label_regex = sys.argv[1], sys.argv[2]
    count, words = test_words(build_dir, label_regex)
    if count == 0:
        print(f"label_targets: no test in {build_dir} matches -L '{label_regex}'", file=sys.stderr)
        return 1
    artifacts = codemodel_artifacts(build_dir)
    targets = {artifacts[os.path.normpath(w)] for w in words if os.path.normpath(w) in artifacts}
    print("\n".join(sorted(targets)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
