"""`dmuon` console script."""
import sys


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    print("usage: dmuon {verify,autotune} ...", file=sys.stderr)
    return 2
