"""python -m fusedps.bench COMMAND [ARGS]: see fusedps/bench/__init__.py."""

import sys

COMMANDS = ("e2e",)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m fusedps.bench {{{','.join(COMMANDS)}}} [--help]",
              file=sys.stderr)
        return 2
    from fusedps.bench import e2e

    return e2e.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
