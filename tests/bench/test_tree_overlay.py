"""bench/tree_overlay.py: a tree carried as its difference from a base is rebuilt file for file; a base other
than the one it was made against, or a missing folder, is one usage line."""
from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bench"))
import tree_overlay  # noqa: E402

sys.path.pop(0)


def _write(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


def test_make_then_apply_rebuilds_the_tree(tmp_path, capsys):
    base = _write(tmp_path / "base", {"a.py": "a", "m/b.py": "b", "m/gone.py": "x", "m/same.py": "s"})
    tree = _write(tmp_path / "tree", {"a.py": "a2", "m/b.py": "b", "m/same.py": "s", "m/new/c.py": "c", "COMMIT": "c1"})
    out, rebuilt = str(tmp_path / "overlay"), tmp_path / "rebuilt"
    assert tree_overlay.main(["make", "--base", base, "--tree", tree, "--out", out]) == 0
    assert sorted(tree_overlay.files_under(os.path.join(out, "files"))) == ["COMMIT", "a.py", "m/new/c.py"]
    assert tree_overlay.main(["apply", "--base", base, "--overlay", out, "--out", str(rebuilt)]) == 0
    got = {rel: open(full).read() for rel, full in tree_overlay.files_under(str(rebuilt)).items()
           if rel != tree_overlay.APPLIED}
    assert got == {"a.py": "a2", "m/b.py": "b", "m/same.py": "s", "m/new/c.py": "c", "COMMIT": "c1"}
    assert "3 file(s) changed or added, 1 deleted" in capsys.readouterr().out
    other = _write(tmp_path / "other", {"a.py": "a-other", "m/b.py": "b", "m/gone.py": "x"})
    for argv, said in [(["apply", "--base", other, "--overlay", out, "--out", str(tmp_path / "r2")],
                        "is not the tree the overlay was made against"),
                       (["apply", "--base", str(tmp_path / "none"), "--overlay", out, "--out", str(tmp_path / "r3")],
                        "is not a directory"),
                       (["make", "--base", base, "--tree", tree, "--out", out], "exists and is not empty"),
                       (["apply", "--base", base, "--overlay", out, "--out", base], "overlaps --base or --overlay"),
                       (["apply", "--base", base, "--overlay", out, "--out", tree], "is not a tree this command wrote")]:
        with pytest.raises(SystemExit) as e:
            tree_overlay.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err and len(err.strip().splitlines()) == 1, err
    assert open(os.path.join(tree, "a.py")).read() == "a2" and os.path.isfile(os.path.join(base, "m", "gone.py"))
    # a tree it wrote before is rebuilt in place
    assert tree_overlay.main(["apply", "--base", base, "--overlay", out, "--out", str(rebuilt)]) == 0
