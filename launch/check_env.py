"""Is the project's venv whole? launch/setup_env.sh runs this on every start (one Python process, no
torch import: ~0.3 s) and repairs what it names.

Every distribution setup_env.sh installs, and every dependency those pull in (their ``Requires-Dist``
without extras, recursively; megatron-core and emerging-optimizers are installed without theirs),
must be installed with every file of its RECORD present (byte-code caches aside), and
``megatron_dmuon`` must import from this checkout (the editable install). A deleted package (psutil:
the start-up memory check needs it) or a deleted subpackage of megatron-core is found here, by name,
before anything imports it ([bad-input-4]: neither was noticed, nor repaired after the stamp was
removed).

stdout: one line of ``pip install`` arguments per repair (torch first, this checkout last), nothing
when all is well; stderr: what is wrong, one line each. Exit status 0 when whole, 1 otherwise.
The install specs follow setup_env.sh's environment (DMUON_TORCH, DMUON_MCORE, DMUON_EMERGING).
"""
from __future__ import annotations

import csv
import importlib.metadata as md
import importlib.util
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# installed with their dependencies (setup_env.sh's pip lines)
WITH_DEPS = ["torch", "numpy", "packaging", "triton", "mip", "psutil", "scipy", "einops", "tensorboard", "wandb", "pytest",
             "pytest-timeout", "matplotlib"]
# installed with --no-deps (megatron-core declares Python >= 3.12 and many optional extras)
NO_DEPS = ["megatron-core", "emerging-optimizers", "absl-py"]
TYPING_PTH = "dmuon_typing_override.pth"  # setup_env.sh's typing.override for megatron-core on Python 3.11


def _specs() -> dict:
    """name -> the pip arguments that install it as setup_env.sh does."""
    return {
        "torch": [os.environ.get("DMUON_TORCH", "torch==2.13.0")],
        "megatron-core": ["--no-deps", "--ignore-requires-python", os.environ.get("DMUON_MCORE", "megatron-core==0.19.2")],
        "emerging-optimizers": ["--no-deps", "--ignore-requires-python",
                                os.environ.get("DMUON_EMERGING", "emerging-optimizers==0.3.0")],
        "absl-py": ["--no-deps", "absl-py"],
    }


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def missing_files(dist) -> list:
    """The files of ``dist``'s RECORD that are not on disk (byte-code caches aside); ['RECORD'] when it has none."""
    record = dist.read_text("RECORD")
    if record is None:
        return ["RECORD"]
    base = str(dist.locate_file(""))
    out = []
    for row in csv.reader(record.splitlines()):
        path = row[0] if row else ""
        if path and "__pycache__" not in path and not path.endswith(".pyc") \
                and not os.path.exists(os.path.join(base, path)):
            out.append(path)
    return out


def _requirements(dist) -> list:
    """(name, 'name<specifier>') of ``dist``'s dependencies without extras, for this Python."""
    from packaging.requirements import Requirement

    out = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append((req.name, f"{req.name}{req.specifier}"))
    return out


def problems() -> list:
    """[(name, pip arguments, what is wrong)] for everything that must be (re)installed."""
    specs, seen, out = _specs(), set(), []
    queue = [(n, None, True) for n in WITH_DEPS] + [(n, None, False) for n in NO_DEPS]
    while queue:
        name, wanted, deps = queue.pop(0)
        if _key(name) in seen:
            continue
        seen.add(_key(name))
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            out.append((name, specs.get(name, [wanted or name]), f"{name} is not installed"))
            continue
        lost = missing_files(dist)
        if lost:
            version = dist.version
            args = specs.get(name, [f"{name}=={version}"])
            out.append((name, ["--force-reinstall", "--no-deps", *[a for a in args if a != "--no-deps"]],
                        f"{name} {version} is damaged: {lost[0]} is missing"
                        + (f" (and {len(lost) - 1} more of its files)" if len(lost) > 1 else "")))
        if deps:
            try:
                queue += [(n, spec, True) for n, spec in _requirements(dist)]
            except Exception as e:  # noqa: BLE001 - packaging itself broken: reported above or here
                out.append(("packaging", ["--force-reinstall", "--no-deps", "packaging>=24.2"],
                            f"cannot read {name}'s requirements ({e})"))
    spec = importlib.util.find_spec("megatron_dmuon")
    here = os.path.join(ROOT, "megatron_dmuon", "__init__.py")
    if spec is None or not spec.origin or not os.path.exists(spec.origin) or not os.path.samefile(spec.origin, here):
        out.append(("megatron_dmuon", ["--no-deps", "-e", ROOT], "megatron_dmuon does not import from this checkout "
                    f"({spec.origin if spec and spec.origin else 'not installed'}; wanted {here})"))
    if sys.version_info < (3, 12) and not any(os.path.exists(os.path.join(d, TYPING_PTH)) for d in sys.path if d):
        out.append((TYPING_PTH, [], f"{TYPING_PTH} (typing.override for megatron-core on Python 3.11) is missing"))
    return sorted(out, key=lambda p: {"torch": 0, "megatron_dmuon": 2}.get(p[0], 1))  # torch first: nothing pulls a CUDA build


def pip_lines(found) -> list:
    """The pip argument lines of ``found``: torch alone first, then one line per set of flags (the
    specs of a fresh venv in one pip call), this checkout's editable install last."""
    lines, groups = [], {}
    for name, args, _ in found:
        if not args:
            continue
        if name in ("torch", "megatron_dmuon"):
            lines.append(args)
            continue
        flags = tuple(a for a in args if a.startswith("-"))
        groups.setdefault(flags, []).extend(a for a in args if not a.startswith("-"))
    torch_first = [a for a in lines if a[-1] != ROOT]
    return torch_first + [[*flags, *specs] for flags, specs in groups.items()] + [a for a in lines if a[-1] == ROOT]


def main() -> None:
    found = problems()
    for _, _, why in found:
        sys.stderr.write(f"launch/check_env.py: {why}\n")
    for args in pip_lines(found):
        print(" ".join(args))
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
