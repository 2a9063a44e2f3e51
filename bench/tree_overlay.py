"""A Megatron-LM tree carried as its difference from another (a device call carries at most 64 MiB, and two
trimmed trees beside TE's build do not fit): ``make`` writes the files of TREE that BASE lacks or holds
otherwise, the list of BASE's files TREE lacks, and the SHA-256 of every BASE file either touches; ``apply``
rebuilds TREE from BASE and the overlay, refusing a BASE whose files differ from the ones it was made against.

    python bench/tree_overlay.py make --base .mlm_main --tree .mlm_pr6683 --out .mlm_pr6683_overlay
    python bench/tree_overlay.py apply --base .mlm_main --overlay .mlm_pr6683_overlay --out /tmp/mlm_pr6683
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_inputs import OneLineParser, read_json  # noqa: E402

MANIFEST = "OVERLAY.json"
APPLIED = ".tree_overlay_applied"  # in a tree apply wrote: the only existing --out apply replaces


def files_under(root: str) -> dict:
    """{relative path: absolute path} of every regular file under ``root`` (links followed at the top only)."""
    out = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in names:
            full = os.path.join(folder, name)
            if os.path.isfile(full) and not name.endswith(".pyc"):
                out[os.path.relpath(full, root)] = full
    return out


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def make(base: str, tree: str, out: str) -> dict:
    base_files, tree_files = files_under(base), files_under(tree)
    changed = sorted(p for p, full in tree_files.items() if p not in base_files or sha256(full) != sha256(base_files[p]))
    deleted = sorted(set(base_files) - set(tree_files))
    for rel in changed:
        os.makedirs(os.path.dirname(os.path.join(out, "files", rel)), exist_ok=True)
        shutil.copy2(tree_files[rel], os.path.join(out, "files", rel))
    manifest = {"changed": changed, "deleted": deleted,
                "base_sha256": {p: sha256(base_files[p]) for p in sorted(set(changed + deleted) & set(base_files))},
                "base_files": len(base_files), "tree_files": len(tree_files)}
    with open(os.path.join(out, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def apply(parser, base: str, overlay: str, out: str) -> dict:
    manifest = read_json(parser, "--overlay", os.path.join(overlay, MANIFEST), "an overlay written by "
                         "tree_overlay.py make", need=("changed", "deleted", "base_sha256"))
    base_files = files_under(base)
    wrong = [p for p, digest in manifest["base_sha256"].items()
             if p not in base_files or sha256(base_files[p]) != digest]
    if wrong:
        parser.error(f"--base {base} is not the tree the overlay was made against ({len(wrong)} file(s) differ, "
                     f"e.g. {wrong[0]}); give that tree (docs/megatron_lm.md §1)")
    if os.path.exists(out):  # only a tree this command wrote before is replaced (checked in main)
        shutil.rmtree(out)
    shutil.copytree(base, out, symlinks=False, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    open(os.path.join(out, APPLIED), "w").close()
    for rel in manifest["deleted"]:
        os.remove(os.path.join(out, rel))
    for rel in manifest["changed"]:
        os.makedirs(os.path.dirname(os.path.join(out, rel)), exist_ok=True)
        shutil.copy2(os.path.join(overlay, "files", rel), os.path.join(out, rel))
    return manifest


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make")
    m.add_argument("--base", required=True)
    m.add_argument("--tree", required=True)
    m.add_argument("--out", required=True)
    a = sub.add_parser("apply")
    a.add_argument("--base", required=True)
    a.add_argument("--overlay", required=True)
    a.add_argument("--out", required=True)
    args = p.parse_args(argv)
    for flag in ("base", "tree", "overlay"):
        path = getattr(args, flag, None)
        if path is not None and not os.path.isdir(path):
            p.error(f"--{flag} {path} is not a directory")
    if args.command == "make":
        if os.path.exists(args.out) and os.listdir(args.out):
            p.error(f"--out {args.out} exists and is not empty; give a new folder")
        done = make(args.base, args.tree, args.out)
    else:
        out, inputs = os.path.realpath(args.out), [os.path.realpath(args.base), os.path.realpath(args.overlay)]
        if any(out == i or out.startswith(i + os.sep) or i.startswith(out + os.sep) for i in inputs):
            p.error(f"--out {args.out} overlaps --base or --overlay; give a folder of its own")
        if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)) \
                and not os.path.isfile(os.path.join(out, APPLIED)):
            p.error(f"--out {args.out} exists and is not a tree this command wrote; give a new folder")
        done = apply(p, args.base, args.overlay, args.out)
    print(f"tree_overlay.py {args.command}: {len(done['changed'])} file(s) changed or added, "
          f"{len(done['deleted'])} deleted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
