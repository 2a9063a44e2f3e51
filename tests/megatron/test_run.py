"""`python -m megatron_dmuon.megatron.run SCRIPT.py ...` (and `dmuon-megatron-lm`): an unmodified
Megatron-LM entry script gets `--optimizer dmuon`.

Every machine: a stand-in tree (the module attributes the hook replaces, real megatron-core behind
them) and an unmodified stand-in script: the hook is in place before the script parses, the script
runs as ``__main__`` from its own directory with its own arguments, and a tree missing a hook point
or a bad command line is refused by name. Where real Megatron-LM trees are around
($DMUON_MEGATRON_LM_TREES, a path list; unpatched trees are the point), their own `pretrain_gpt.py`
and `pretrain_mamba.py`: without the launcher Megatron refuses `--optimizer dmuon`; with it the
hook's start-up check answers, and a valid command line is parsed and validated as DMuon's and goes
on to Megatron's own start (which asks for CUDA on a CPU machine)."""
import os
import subprocess
import sys
import textwrap

import pytest

from tests import ROOT

LAUNCHER = [sys.executable, "-m", "megatron_dmuon.megatron.run"]

STAND_IN = {
    # the tree's megatron package; megatron.core stays the installed megatron-core
    "megatron/__init__.py": "from pkgutil import extend_path\n__path__ = extend_path(__path__, __name__)\n",
    "megatron/training/__init__.py": "",
    "megatron/training/arguments.py": """
        import argparse


        def add_megatron_arguments(parser):
            parser.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "muon"])
            parser.add_argument("--use-distributed-optimizer", action="store_true")
            parser.add_argument("--overlap-grad-reduce", action="store_true")
            parser.add_argument("--overlap-param-gather", action="store_true")
            return parser


        def validate_args(args, defaults={}):
            return args


        def parse_args():  # as Megatron's: module globals, so the hook's replacements are called
            args = add_megatron_arguments(argparse.ArgumentParser(prog="pretrain_stand_in.py")).parse_args()
            validate_args(args, {})
            return args
        """,
    "megatron/training/training.py": """
        DDP = object
        get_megatron_optimizer = clip_qk = load_checkpoint = train = training_log = print
        """,
    "megatron/training/checkpointing.py": "_load_base_checkpoint = print\n",
    "megatron/training/models/__init__.py": "",
    "megatron/training/models/dist_utils.py": "DistributedDataParallel = object\n",
    "neighbour.py": "NAME = 'the script directory is on sys.path'\n",
    "pretrain_stand_in.py": """
        import sys

        import neighbour
        from megatron.training import arguments, training

        if __name__ == "__main__":
            args = arguments.parse_args()
            print("RESULT", args.optimizer, args.use_distributed_optimizer, training.DDP.__name__,
                  training.get_megatron_optimizer.__module__, neighbour.NAME.split()[1], sys.argv[0].rsplit("/", 1)[-1])
        """,
}


def _stand_in_tree(root, drop=None):
    for rel, text in STAND_IN.items():
        if drop and rel == drop[0]:
            text = text.replace(drop[1], "_gone")
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(textwrap.dedent(text))
    return os.path.join(root, "pretrain_stand_in.py")


def _run(cmd, cwd, extra_path=(), timeout=300, world_size=1):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*extra_path, ROOT]), PYTHONWARNINGS="ignore",
               WORLD_SIZE=str(world_size), RANK="0")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def test_an_unmodified_script_gets_dmuon_through_the_launcher(tmp_path):
    script = _stand_in_tree(str(tmp_path / "tree"))
    ok = _run([*LAUNCHER, script, "--optimizer", "dmuon", "--use-distributed-optimizer"], cwd=str(tmp_path))
    assert ok.returncode == 0, ok.stderr[-3000:]
    result = ok.stdout.split("RESULT", 1)[1].split()
    assert result[:2] == ["dmuon", "True"] and result[2].endswith("DMuonDDP"), ok.stdout
    assert result[3:] == ["megatron_dmuon.megatron.megatron_lm", "script", "pretrain_stand_in.py"], ok.stdout
    # the hook's own start-up check answers a DMuon run Megatron would have built as something else
    bad = _run([*LAUNCHER, script, "--optimizer", "dmuon"], cwd=str(tmp_path))
    assert bad.returncode == 2 and "--optimizer dmuon needs --use-distributed-optimizer" in bad.stderr
    # the same script without the launcher: Megatron's parser does not know dmuon
    plain = _run([sys.executable, script, "--optimizer", "dmuon"], cwd=str(tmp_path))
    assert plain.returncode == 2 and "invalid choice: 'dmuon'" in plain.stderr
    # other optimizers pass through untouched; through a symlink the script runs in its own tree (before:
    # its neighbours' imports failed before, ModuleNotFoundError for gpt_builders in Megatron-LM)
    (tmp_path / "elsewhere").mkdir()
    link = tmp_path / "elsewhere" / "pretrain_gpt.py"
    link.symlink_to(script)
    adam = _run([*LAUNCHER, str(link), "--optimizer", "adam"], cwd=str(tmp_path))
    assert adam.returncode == 0, adam.stderr[-2000:]
    assert adam.stdout.split("RESULT", 1)[1].split() == ["adam", "False", "object", "builtins", "script",
                                                         "pretrain_stand_in.py"], adam.stdout


def test_a_tree_missing_a_hook_point_or_a_bad_command_line_is_refused_by_name(tmp_path):
    script = _stand_in_tree(str(tmp_path / "tree"), drop=("megatron/training/training.py", "clip_qk"))
    out = _run([*LAUNCHER, script, "--optimizer", "dmuon"], cwd=str(tmp_path))
    assert out.returncode == 2 and "megatron.training.training.clip_qk" in out.stderr and "RESULT" not in out.stdout
    usage = _run(LAUNCHER, cwd=str(tmp_path))
    assert usage.returncode == 2 and "usage: python -m megatron_dmuon.megatron.run" in usage.stderr
    missing = _run([*LAUNCHER, str(tmp_path / "nope.py")], cwd=str(tmp_path))
    assert missing.returncode == 2 and "nope.py is not a Python script" in missing.stderr
    # a tree module that imports a package this environment lacks: the ImportError and the fix,
    # not "this Megatron-LM's megatron.training has no ..." (the supported-trees message) as before
    script = _stand_in_tree(str(tmp_path / "tree_needs"))
    training = tmp_path / "tree_needs" / "megatron" / "training" / "checkpointing.py"
    training.write_text("import dmuon_test_missing_dependency.sub\n" + training.read_text())
    out = _run([*LAUNCHER, script, "--optimizer", "dmuon"], cwd=str(tmp_path))
    assert out.returncode == 2 and "RESULT" not in out.stdout, out.stderr[-2000:]
    assert "importing megatron.training.checkpointing from" in out.stderr, out.stderr[-2000:]
    assert "No module named 'dmuon_test_missing_dependency'" in out.stderr, out.stderr[-2000:]
    assert "pip install dmuon_test_missing_dependency" in out.stderr and "supported trees" not in out.stderr


def test_a_script_outside_a_megatron_lm_tree_is_refused_before_it_runs(tmp_path, monkeypatch, capsys):
    """Megatron-core's wheel ships a megatron.training, so any script ran (hello.py), and a
    pretrain_gpt.py copied out of its checkout failed inside Megatron-LM (ModuleNotFoundError gpt_builders)."""
    from megatron_dmuon.megatron import run

    monkeypatch.delenv("PYTHONPATH", raising=False)
    hello = tmp_path / "hello.py"
    hello.write_text("open('ran', 'w').write('it ran')\n")
    tree = os.path.dirname(_stand_in_tree(str(tmp_path / "Megatron-LM")))
    (tmp_path / "Megatron-LM" / "pretrain_gpt.py").write_text("print('a checkout')\n")
    copied = tmp_path / "copied"
    copied.mkdir()
    (copied / "pretrain_gpt.py").write_text("import gpt_builders\n")
    expect = {hello: f"{tmp_path} is not a Megatron-LM checkout (no megatron/training/ beside hello.py, and no "
                     "checkout on PYTHONPATH)",
              copied / "pretrain_gpt.py": f"{copied / 'pretrain_gpt.py'} is Megatron-LM's pretrain_gpt.py outside "
                                          f"its checkout: its tree (megatron/training/, the builders it imports) is "
                                          f"not beside it in {copied}. Run the checkout's own script"}
    for script, message in expect.items():
        with pytest.raises(SystemExit) as exit_info:
            run.main([str(script), "--optimizer", "dmuon"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err and "PYTHONPATH" in err, err
        assert not (tmp_path / "ran").exists() and str(script.parent) not in sys.path
    # the fixes: the checkout's own script, or the checkout on PYTHONPATH for a copy
    assert run.script_tree(os.path.join(tree, "pretrain_stand_in.py")) == (os.path.join(os.path.realpath(tree),
                                                                                           "pretrain_stand_in.py"),
                                                                              os.path.realpath(tree))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "nothing"), tree]))
    assert run.script_tree(str(copied / "pretrain_gpt.py"))[1] == tree


def _real_trees():
    paths = filter(None, os.environ.get("DMUON_MEGATRON_LM_TREES", "").split(os.pathsep))
    return [p for p in paths if os.path.isfile(os.path.join(p, "megatron", "training", "arguments.py"))]


PY311 = """import typing
typing.override = getattr(typing, "override", lambda f: f)  # Megatron-LM needs Python 3.12's typing.override
"""
SMALL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
         "--micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr 1e-3 --mock-data --tokenizer-type "
         "NullTokenizer --vocab-size 1000 --transformer-impl local --bf16").split()


@pytest.mark.skipif(not _real_trees(), reason="no Megatron-LM trees in $DMUON_MEGATRON_LM_TREES")
@pytest.mark.parametrize("tree", _real_trees() or [None])
@pytest.mark.parametrize("script", ["pretrain_gpt.py", "pretrain_mamba.py", "pretrain_hybrid.py"])
def test_real_unmodified_scripts_take_dmuon_through_the_launcher(tree, script, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PY311)
    path = os.path.join(tree, script)
    if not os.path.isfile(path):
        pytest.skip(f"{tree} has no {script}")
    extra = [str(site)]
    plain = _run([sys.executable, path, *SMALL, "--optimizer", "dmuon"], cwd=str(tmp_path), extra_path=extra)
    assert plain.returncode == 2 and "invalid choice: 'dmuon'" in plain.stderr, plain.stderr[-2000:]
    bad = _run([*LAUNCHER, path, *SMALL, "--optimizer", "dmuon"], cwd=str(tmp_path), extra_path=extra)
    assert bad.returncode == 2 and "--optimizer dmuon needs --use-distributed-optimizer" in bad.stderr, bad.stderr[-2000:]
    ok = _run([*LAUNCHER, path, *SMALL, "--optimizer", "dmuon", "--use-distributed-optimizer", "--muon-momentum",
               "0.95", "--dmuon-overlap-step", "sync"], cwd=str(tmp_path), extra_path=extra)
    # parsed and validated as DMuon's run, then Megatron's own start (on a GPU machine: training)
    assert "--optimizer dmuon: the argument dump above shows 'optimizer adam'" in ok.stdout, ok.stderr[-2000:]
    assert "dmuon_overlap_step .............................. sync" in ok.stdout
    if ok.returncode != 0:
        assert "Megatron requires CUDA" in ok.stderr, ok.stderr[-2000:]
    if script != "pretrain_gpt.py":
        return
    # Megatron's partial distributed optimizer and the split layout ([scale-past-matrices]), on 4 ranks' worth of DP
    instances = _run([*LAUNCHER, path, *SMALL, "--global-batch-size", "8", "--optimizer", "dmuon",
                      "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2", "--dmuon-dp-layout",
                      "split"],
                     cwd=str(tmp_path), extra_path=extra, world_size=4)
    assert "--optimizer dmuon: the argument dump above" in instances.stdout, instances.stderr[-2000:]
    assert "num_distributed_optimizer_instances ............. 2" in instances.stdout
    assert "dmuon_dp_layout ................................. split" in instances.stdout
    assert instances.returncode == 0 or "Megatron requires CUDA" in instances.stderr, instances.stderr[-2000:]
