"""The command-line inputs of bench/'s scripts, checked before any work: a usage error is one line,
``PROG: error: ...``, exit 2, never a traceback ([bad-input-5]: ``rank_balance.py check`` with a missing
or garbage JSON ended in tracebacks, with no input at all in an empty table and exit 0;
``fp8_ns.py --device cuda`` without CUDA in an AssertionError).

    from cli_inputs import OneLineParser, check_device, read_json
    p = OneLineParser(...)                                  # argparse's own errors: one line too
    doc = read_json(p, "--emulation", path, "the JSON of an emulate run", need=("layouts",))
    check_device(p, args.device)

A file a flag names must be a regular file of bounded size (megatron_dmuon/files.py), hold text, and
be the JSON document the flag takes: an object with the keys it needs; otherwise the message names
the flag, the file, what is wrong and what to give.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # (the repository, for the package)

from megatron_dmuon.files import read_bounded_text  # noqa: E402


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (exit 2); ``-h`` still lists the flags. Subcommand
    parsers are of the same class (argparse makes them of the parent's). ``about``: what the message is
    about, written before it (a parser of one flag's value: ``about="--flags: "``)."""

    def __init__(self, *args, about: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.about = about

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {self.about}{message}\n")


def without_fix(message: str) -> str:
    """megatron_dmuon/files.py's message without its generic fix (the caller says what to give)."""
    return message.removesuffix(": give a file")


def _json_kind(data) -> str:
    return {dict: "a JSON object", list: "a JSON list", str: "a JSON string"}.get(type(data), f"JSON {data!r}"[:40])


def read_json(parser, flag: str, path: str, kind: str, need=(), any_of=()) -> dict:
    """The JSON object in the file ``path`` that ``flag`` names; a usage error (``parser.error``) naming
    the flag, the file, what is wrong and ``kind`` (what to give) when the file is missing, not a
    regular file, empty, not JSON, or not an object holding every key of ``need`` and one of
    ``any_of`` (where given)."""
    try:
        text = read_bounded_text(path, flag)
    except ValueError as e:
        parser.error(f"{without_fix(str(e))}; give {kind}")
    if not text.strip():
        parser.error(f"{flag} {path} is empty; give {kind}")
    try:
        data = json.loads(text)
    except ValueError as e:
        parser.error(f"{flag} {path} is not JSON ({e}); give {kind}")
    if not isinstance(data, dict):
        parser.error(f"{flag} {path} holds {_json_kind(data)}, not an object; give {kind}")
    missing = [k for k in need if k not in data]
    if missing or (any_of and not any(k in data for k in any_of)):
        keys = ", ".join(map(repr, sorted(data)[:6])) + (", ..." if len(data) > 6 else "") or "none"
        wants = " and ".join(map(repr, missing)) if missing else " or ".join(map(repr, any_of))
        parser.error(f"{flag} {path} holds no {wants} (its keys: {keys}); give {kind}")
    return data


APPLY_PATCHES = os.path.join(ROOT, "patches", "apply.sh")


def patch_megatron_lm_tree(parser, flag: str, path: str, run) -> None:
    """patches/apply.sh on the Megatron-LM checkout ``path`` (through ``run``, the caller's
    ``subprocess.run``): a missing directory, or a tree the script cannot patch, is a usage error naming
    the flag (a CalledProcessError traceback before)."""
    import subprocess

    if not os.path.isdir(path):
        parser.error(f"{flag} {path} is not a directory; give a Megatron-LM checkout (git clone "
                     "https://github.com/NVIDIA/Megatron-LM, core_v0.19.0)")
    try:
        done = run(["bash", APPLY_PATCHES, path], check=True, stderr=subprocess.PIPE, text=True)
    except subprocess.CalledProcessError as e:
        said = (e.stderr or "").strip().splitlines()
        parser.error(f"{flag} {path}: patches/apply.sh could not patch it ({said[-1] if said else f'exit {e.returncode}'})")
    if getattr(done, "stderr", None):  # what it reported on success (the patches it applied)
        sys.stderr.write(done.stderr)


def check_device(parser, device: str) -> None:
    """``--device`` names a device this machine has: ``cuda`` (or ``cuda:N``) needs a CUDA GPU."""
    import torch

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            parser.error(f"--device {device}: no CUDA device here (torch {torch.__version__}, built for CUDA "
                         f"{torch.version.cuda or 'none'}); run on a GPU machine, or pass --device cpu")
        index = device.partition(":")[2]
        if index and not (index.isdigit() and int(index) < torch.cuda.device_count()):
            parser.error(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device != "cpu":
        parser.error(f"--device {device}: give cpu or cuda")
