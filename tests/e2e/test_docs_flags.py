"""docs/reference/server-flags.md against the server binary's own `--help` (issue 36): the
server's flags are documented once, and that page cannot drift from the binary.

- every flag that `$FUSEDPS_SERVER --help` lists has exactly one row on the page;
- each row's default is the binary's;
- the page names no flag (`--name` anywhere in its text) that the binary lacks.

Which flags are the server's own: `fusedps-server --help` (common/flag_usage.h) lists only the
flags defined in the server's main file, not absl's, glog's or gRPC's. Should the help ever be
absl's layout instead, with a "Flags from FILE:" line before each file's flags, only those of
files under server/ count. Either way the test insists on a sane count, so that a help text it
can no longer read fails it instead of passing it empty.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from server_fixture import REPO_ROOT, server_path

PAGE = os.path.join(REPO_ROOT, "docs", "reference", "server-flags.md")

# `  --listen (default: "0.0.0.0:50051")`, then the help text, indented further.
HELP_FLAG = re.compile(r"^\s{1,4}--([A-Za-z0-9][A-Za-z0-9_-]*) \(default: (.*)\)\s*$")
# absl's --helpfull layout: `  Flags from server/main.cc:`.
HELP_FILE = re.compile(r"^\s*Flags from (\S+):\s*$")
# A row of the page: | `--listen` | `0.0.0.0:50051` | what it does | deployments |
ROW = re.compile(r"^\| `--([a-z0-9][a-z0-9-]*)` \| `([^`]*)` \|", re.M)
# Any flag the page names, in a table, a sentence or an example command.
NAMED = re.compile(r"(?<![\w-])--([a-z][a-z0-9_-]*)")
# Named on the page without being a flag of the server.
NOT_SERVER_FLAGS = {"help"}


def _kebab(name: str) -> str:
    return name.replace("_", "-")


def _shown_default(value: str) -> str:
    """A default as the page shows it: string defaults without their quotes, "" when empty."""
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = value[1:-1]
    return value if value else '""'


def parse_help(text: str) -> dict[str, str]:
    """{flag: default} of the server's own flags in a --help text."""
    flags: dict[str, str] = {}
    in_server_file = None  # None: no "Flags from" lines, every listed flag is the server's.
    for line in text.splitlines():
        header = HELP_FILE.match(line)
        if header:
            path = header.group(1).replace("\\", "/")
            in_server_file = path.startswith("server/") or "/server/" in path
            continue
        flag = HELP_FLAG.match(line)
        if flag and in_server_file is not False:
            flags[_kebab(flag.group(1))] = _shown_default(flag.group(2))
    return flags


@pytest.fixture(scope="module")
def server_flags() -> dict[str, str]:
    binary = server_path()
    if not os.path.exists(binary):
        pytest.fail(f"fusedps-server not found at {binary!r} (set FUSEDPS_SERVER)")
    result = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{binary} --help exited {result.returncode}:\n{result.stderr}"
    flags = parse_help(result.stdout)
    # Sanity: the help still lists flags in a form this test reads, and they are the server's.
    assert len(flags) >= 20 and "listen" in flags and "device" in flags, (
        f"read {sorted(flags)} from {binary} --help; has its layout changed?\n{result.stdout}")
    return flags


@pytest.fixture(scope="module")
def page() -> str:
    with open(PAGE, encoding="utf-8") as f:
        return f.read()


def page_rows(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in ROW.finditer(text)]


def test_every_server_flag_has_one_row(server_flags, page):
    rows = [name for name, _ in page_rows(page)]
    missing = sorted(set(server_flags) - set(rows))
    assert not missing, (
        f"docs/reference/server-flags.md has no row for {', '.join('--' + f for f in missing)}: "
        "add one (`fusedps-server --help` has its default and help text)")
    repeated = sorted({name for name in rows if rows.count(name) > 1})
    assert not repeated, f"more than one row for {repeated}"


def test_each_row_gives_the_binarys_default(server_flags, page):
    wrong = {name: (shown, server_flags[name]) for name, shown in page_rows(page)
             if name in server_flags and shown != server_flags[name]}
    assert not wrong, "defaults on the page differ from --help's (page, binary): " + ", ".join(
        f"--{name}: {page_value!r} against {binary_value!r}"
        for name, (page_value, binary_value) in sorted(wrong.items()))


def test_the_page_names_no_flag_the_server_lacks(server_flags, page):
    def known(name: str) -> bool:
        name = _kebab(name)
        if name in server_flags or name in NOT_SERVER_FLAGS:
            return True
        # --noNAME turns off a boolean flag.
        return name.startswith("no") and server_flags.get(name[2:]) in ("true", "false")

    unknown = sorted({m.group(1) for m in NAMED.finditer(page) if not known(m.group(1))})
    assert not unknown, (
        "docs/reference/server-flags.md names flags that fusedps-server --help does not list: "
        + ", ".join("--" + f for f in unknown))


def test_parse_help_keeps_only_server_files_in_absls_layout():
    text = "\n".join([
        "  Flags from external/absl/flags/parse.cc:",
        "    --flagfile (default: \"\")",
        "  Flags from server/main.cc:",
        "    --listen (default: \"0.0.0.0:50051\")",
        "      gRPC address",
        "    --max_message_bytes (default: 8388608)",
        "  Flags from src/core/lib/debug/trace.cc:",
        "    --grpc_trace (default: \"\")",
    ])
    assert parse_help(text) == {"listen": "0.0.0.0:50051", "max-message-bytes": "8388608"}
