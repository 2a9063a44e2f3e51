"""`dmuon` console script: `dmuon autotune ...`, `dmuon plan ...`.

The self-tests built on the test harness have their own console scripts, `dmuon-verify` and
`dmuon-check` (megatron_dmuon.testing.verify_cli / check_cli), so no production module imports it."""
import sys

USAGE = ("usage: dmuon {autotune,plan} [options]   (dmuon <command> --help for details)\n"
         "self-tests: dmuon-verify, dmuon-check")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in ("verify", "check"):
        print(f"dmuon: the self-test is its own command: dmuon-{cmd} (python -m megatron_dmuon.testing.{cmd}_cli)",
              file=sys.stderr)
        return 2
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
