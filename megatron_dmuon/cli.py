"""`dmuon` console script: `dmuon verify ...`, `dmuon check ...`, `dmuon autotune ...`, `dmuon plan ...`."""
import sys

USAGE = "usage: dmuon {verify,check,autotune,plan} [options]   (dmuon <command> --help for details)"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "verify":
        from .testing.verify_cli import main as verify_main

        return verify_main(rest)
    if cmd == "check":
        from .testing.check_cli import main as check_main

        return check_main(rest)
    if cmd == "autotune":
        from .kernels.autotune_cli import main as autotune_main

        return autotune_main(rest)
    if cmd == "plan":
        from .planning.plan_cli import main as plan_main

        return plan_main(rest)
    print(f"dmuon: unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
