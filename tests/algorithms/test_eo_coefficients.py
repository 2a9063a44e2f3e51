"""Every `--muon-coefficient-type` under `--optimizer dmuon` runs Emerging-Optimizers' own rule: DMuon's
NS (the owner's CPU path, configured from the flags) against Emerging-Optimizers' real
`newton_schulz` on the same fp32 inputs, at step counts inside and past each type's table (where
it cycles or repeats its last set), deepseekv4's 10 steps included.

Two Emerging-Optimizers releases are compared: the installed one (0.3.0 from the registry, what CI
has), and 0.4.0 where $DMUON_EO040 names a directory holding its `emerging_optimizers` package (a
source tree of tag v0.4.0 of NVIDIA-NeMo/Emerging-Optimizers, or a `pip install --target` of it; the
registry serves 0.3.0 only); without it that case is skipped with the reason. Each release runs in
its own Python process, so 0.4.0 never meets the installed 0.3.0's modules.

fp32 only: Emerging-Optimizers' newton_schulz refuses any other input dtype. Its 'high' precision
is compared (full fp32 on CPU); 'medium' casts to bf16 after normalising, DMuon before, which is
bf16 rounding, not the rule.
"""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from packaging.version import Version

from megatron_dmuon.algorithms.eo_coefficients import EO_COEFFICIENT_TYPES, EO_TABLES, FIXED_STEPS
from megatron_dmuon.megatron.config import DMuonConfig
from megatron_dmuon.megatron.train import args as job_args
from megatron_dmuon.runtime.owner_step import default_orthogonalizer

from tests import ROOT

STEPS = (3, 5, 7, 10, 12)  # inside every table, past quintic's/cans'/cubic5's 5, aol's 4, polar_express's 8
SHAPES = ((48, 160), (96, 64), (3, 40, 56))  # wide, tall (EO transposes it), a stack (its batched path)
EO_040_ENV = "DMUON_EO040"

# In the Emerging-Optimizers process: its version, its NSCoeffT and newton_schulz of every case
# (inputs from seeded generators, so both processes hold the same ones without shipping them).
EO_SCRIPT = r"""
import json, sys, typing
import torch
import emerging_optimizers
from emerging_optimizers.orthogonalized_optimizers.muon_utils import NSCoeffT, newton_schulz
torch.set_float32_matmul_precision("highest")
cases, out = json.loads(sys.argv[1]), sys.argv[2]
results = []
for coefficient_type, steps, shape, seed in cases:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    try:
        results.append(newton_schulz(x, steps, coefficient_type))
    except ValueError as e:
        results.append(str(e))
torch.save({"version": emerging_optimizers.__version__, "types": list(typing.get_args(NSCoeffT)),
            "file": emerging_optimizers.__file__, "results": results}, out)
"""


def _cases():
    cases = []
    for coefficient_type in EO_COEFFICIENT_TYPES + ("custom",):
        steps = STEPS + tuple(FIXED_STEPS.get(coefficient_type, 5) + d for d in (0, 2))
        for n in sorted(set(steps)):
            for shape in SHAPES:
                cases.append((coefficient_type, n, list(shape), len(cases)))
    return cases


def _eo_040_path():
    path = os.environ.get(EO_040_ENV)
    return path if path and os.path.isfile(os.path.join(path, "emerging_optimizers", "__init__.py")) else None


def _installed_eo() -> bool:
    import importlib.util

    return importlib.util.find_spec("emerging_optimizers") is not None


SOURCES = {
    "installed": (None, None if _installed_eo() else "emerging_optimizers is not installed"),
    "0.4.0": (_eo_040_path(), None if _eo_040_path() else
              f"${EO_040_ENV} does not name a directory holding Emerging-Optimizers 0.4.0's emerging_optimizers "
              "package (git archive v0.4.0 of NVIDIA-NeMo/Emerging-Optimizers, or pip install --no-deps "
              "--ignore-requires-python --target DIR of it)"),
}


@pytest.fixture(scope="module", params=sorted(SOURCES))
def eo(request, tmp_path_factory):
    """One Emerging-Optimizers release's outputs of every case (its own process)."""
    path, skip = SOURCES[request.param]
    if skip:
        pytest.skip(skip)
    out = tmp_path_factory.mktemp("eo") / "eo.pt"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    if path:  # first on the path: it shadows the installed release
        env["PYTHONPATH"] = os.pathsep.join([path] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-c", EO_SCRIPT, json.dumps(_cases()), str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = torch.load(out)
    if request.param == "0.4.0":
        assert doc["version"] == "0.4.0" and doc["file"].startswith(os.path.abspath(path)), doc["file"]
    return doc


@functools.lru_cache(maxsize=None)
def _dmuon_ns(coefficient_type: str, steps: int):
    """DMuon's NS under these flags: the main job's parser (the hook registers the same flags), the
    config they give, and the orthogonalizer an owner runs on CPU."""
    args = job_args.parse_args(["--muon-coefficient-type", coefficient_type, "--muon-num-ns-steps", str(steps),
                                "--muon-fp32-matmul-prec", "high"])
    return default_orthogonalizer(DMuonConfig.from_args(args).muon)


def test_dmuon_offers_every_coefficient_type_of_the_release(eo):
    types = set(eo["types"]) - {"custom"}  # (custom: refused by name, tests/megatron/test_megatron_lm.py)
    assert types <= set(EO_COEFFICIENT_TYPES), types - set(EO_COEFFICIENT_TYPES)
    if Version(eo["version"]) >= Version("0.4"):
        assert types == set(EO_COEFFICIENT_TYPES)


def test_each_type_is_emerging_optimizers_rule_step_for_step(eo):
    """Equal within fp32 rounding (bitwise today: the same products in the same order)."""
    worst = {}
    torch.set_float32_matmul_precision("highest")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reference's process (OMP_NUM_THREADS=1): CPU GEMMs round by their blocking
    try:
        _compare_each_type(eo, worst)
    finally:
        torch.set_num_threads(threads)
    assert {t for t, _ in worst} == set(eo["types"]) - {"custom"}
    assert ("deepseekv4", 10) in worst
    bad = {k: v for k, v in worst.items() if v > 1e-6}
    assert not bad, bad


def _compare_each_type(eo, worst) -> None:
    for (coefficient_type, steps, shape, seed), ref in zip(_cases(), eo["results"]):
        if coefficient_type == "custom":  # no sets passed (as from Megatron-LM): EO has no rule to run
            assert isinstance(ref, str) and "custom_coefficient_sets" in ref, ref
            continue
        if coefficient_type not in eo["types"]:  # (cubic5 under 0.3.x)
            continue
        if isinstance(ref, str):  # EO refused: only cubic5 at another step count, which DMuon refuses too
            assert coefficient_type in FIXED_STEPS and steps != FIXED_STEPS[coefficient_type], ref
            with pytest.raises(SystemExit):
                _dmuon_ns(coefficient_type, steps)
            continue
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
        ours = _dmuon_ns(coefficient_type, steps)(x)
        rel = float((ours - ref).norm() / ref.norm())
        worst[coefficient_type, steps] = max(rel, worst.get((coefficient_type, steps), 0.0))


def test_polar_express_is_emerging_optimizers_not_dmuons_own_variant():
    """--muon-coefficient-type polar_express is EO's 8 rounded, damped sets (the last repeating);
    --dmuon-coefficients polar_express stays DMuon's own (the published sets, fifth undamped)."""
    from megatron_dmuon.algorithms.coefficients import get_coefficients

    for steps in (3, 5, 8, 10):
        cfg = DMuonConfig.from_args(job_args.parse_args(["--muon-coefficient-type", "polar_express",
                                                         "--muon-num-ns-steps", str(steps)]))
        table = EO_TABLES["polar_express"]
        assert get_coefficients(cfg.muon.coefficients, steps) == [table[min(i, len(table) - 1)] for i in range(steps)]
        own = DMuonConfig.from_args(job_args.parse_args(["--dmuon-coefficients", "polar_express",
                                                         "--muon-num-ns-steps", str(steps)]))
        assert own.muon.coefficients == "polar_express"
        assert get_coefficients(own.muon.coefficients, steps) != get_coefficients(cfg.muon.coefficients, steps)


def test_every_type_maps_back_to_megatrons_own_field():
    """--dmuon-mode megatron_layerwise hands the same rule to Megatron's Muon: each type's schedule maps
    back to its name (deepseekv4 within 8 steps is Keller's set every step: 'simple', the same sets)."""
    from megatron_dmuon.megatron.megatron_lm_flags import megatron_muon_fields

    for coefficient_type in EO_COEFFICIENT_TYPES:
        for steps in (5, 10):
            if coefficient_type in FIXED_STEPS and steps != FIXED_STEPS[coefficient_type]:
                continue
            cfg = DMuonConfig.from_args(job_args.parse_args(["--muon-coefficient-type", coefficient_type,
                                                             "--muon-num-ns-steps", str(steps)]))
            expected = "simple" if (coefficient_type, steps) == ("deepseekv4", 5) else coefficient_type
            assert megatron_muon_fields(cfg)["muon_coefficient_type"] == expected, (coefficient_type, steps)
    own = DMuonConfig.from_args(job_args.parse_args(["--dmuon-coefficients", "polar_express"]))
    with pytest.raises(ValueError, match="DMuon's own variant"):
        megatron_muon_fields(own)


def test_muon_use_syrk_is_accepted_and_changes_nothing():
    plain = DMuonConfig.from_args(job_args.parse_args([]))
    assert DMuonConfig.from_args(job_args.parse_args(["--muon-use-syrk"])) == plain


@pytest.mark.parametrize("argv,message", [
    (["--muon-coefficient-type", "custom"], "--muon-coefficient-type custom: Megatron-LM has no flag"),
    (["--muon-coefficient-type", "cubic5", "--muon-num-ns-steps", "4"], "pass --muon-num-ns-steps 5"),
])
def test_what_has_no_rule_to_match_is_refused_by_name(argv, message):
    from megatron_dmuon.megatron.megatron_lm_flags import muon_coefficients_for

    flags = dict(zip(argv[::2], argv[1::2]))
    with pytest.raises(ValueError, match=re.escape(message)):
        muon_coefficients_for(flags["--muon-coefficient-type"], int(flags.get("--muon-num-ns-steps", 5)))


# In a Megatron-LM tree's process, the hook installed: the tree's own list of types (read from the
# Emerging-Optimizers it imports), then its parser and validate_args on each argv; per argv the
# schedule DMuon runs, or the parse error.
TREE_SCRIPT = r"""
import contextlib, io, json, sys, typing
typing.override = getattr(typing, 'override', lambda f: f)  # Python 3.11
import megatron_dmuon.megatron as dm; dm.install()
import megatron.training.arguments as arguments
from megatron_dmuon.algorithms.coefficients import get_coefficients
from megatron_dmuon.megatron.config import config_of
out = {}
try:
    from megatron.core.optimizer.emerging_optimizers import get_supported_coefficient_types
    import emerging_optimizers
    out["eo"] = [emerging_optimizers.__version__, list(get_supported_coefficient_types())]
except ImportError as e:
    out["eo"] = [None, str(e)]
base, runs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for name, argv in runs.items():
    sys.argv = ["pretrain_gpt.py", *base, *argv]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = arguments.parse_args()
            arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
        m = config_of(args).muon
        out[name] = {"schedule": get_coefficients(m.coefficients, m.ns_steps), "syrk": args.muon_use_syrk}
    except SystemExit as e:
        out[name] = {"exit": e.code, "error": err.getvalue().strip().splitlines()[-1]}
print("RESULT " + json.dumps(out))
"""
TREE_BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
             "--micro-batch-size 2 --global-batch-size 4 --train-iters 5 --lr 1e-3 --mock-data --tokenizer-type "
             "NullTokenizer --vocab-size 1000 --transformer-impl local --bf16 --optimizer dmuon "
             "--use-distributed-optimizer").split()


def _trees():
    """Megatron-LM trees: $DMUON_MEGATRON_LM_TREES (a path list), $DMUON_MEGATRON_LM, .mlm/ (as the hook's tests)."""
    paths = [*filter(None, os.environ.get("DMUON_MEGATRON_LM_TREES", "").split(os.pathsep)),
             os.environ.get("DMUON_MEGATRON_LM") or os.path.join(ROOT, ".mlm")]
    return [p for p in dict.fromkeys(paths) if os.path.isfile(os.path.join(p, "megatron", "training", "arguments.py"))]


@pytest.mark.skipif(not _trees(), reason="no Megatron-LM tree ($DMUON_MEGATRON_LM_TREES, $DMUON_MEGATRON_LM or .mlm/)")
@pytest.mark.parametrize("tree", _trees() or [None])
def test_a_megatron_lm_tree_parses_every_type_and_syrk_under_dmuon(tree):
    """Megatron-LM's own parser and validate_args (hook installed; Emerging-Optimizers 0.4.0 on the path
    where $DMUON_EO040 names it): every type the tree offers with the Emerging-Optimizers it imports
    runs that type's sets under --optimizer dmuon, --muon-use-syrk included; custom is refused by name."""
    from tests.megatron.test_megatron_lm import tree_pythonpath

    runs = {f"{t} {n}": ["--muon-coefficient-type", t, "--muon-num-ns-steps", str(n), "--muon-use-syrk"]
            for t in EO_COEFFICIENT_TYPES for n in (FIXED_STEPS.get(t, 10),)}
    runs["custom"] = ["--muon-coefficient-type", "custom"]
    env = dict(os.environ, PYTHONPATH=tree_pythonpath(tree), WORLD_SIZE="1", RANK="0", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", TREE_SCRIPT, json.dumps(TREE_BASE), json.dumps(runs)], env=env,
                          cwd=tree, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    from megatron_dmuon.algorithms.eo_coefficients import eo_schedule

    for name, argv in runs.items():
        if name == "custom":
            assert out[name]["exit"] == 2 and "--muon-coefficient-type custom" in out[name]["error"], out[name]
            continue
        coefficient_type, steps = name.split()
        assert out[name] == {"schedule": [list(c) for c in eo_schedule(coefficient_type, int(steps))], "syrk": True}
    version, offered = out["eo"]
    if version is not None:  # the tree's choices with this Emerging-Optimizers: each one DMuon's or refused
        assert set(offered) <= set(EO_COEFFICIENT_TYPES) | {"custom"}, offered
        if os.environ.get(EO_040_ENV):
            assert version == "0.4.0" and set(offered) == set(EO_COEFFICIENT_TYPES) | {"custom"}, out["eo"]
