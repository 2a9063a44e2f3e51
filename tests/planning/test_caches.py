"""The tools: the caches DMuon writes (owner plans, NS/rank profiles, autotune) never
replace a file they did not write, `dmuon plan`'s files and numbers fail by name (exit 2, one line).
The Megatron-LM launcher's cases are in tests/megatron/test_run.py, the Slurm renderer's and the
one-node launcher's in tests/launch/test_scripts.py."""
from __future__ import annotations

import json
import os
import stat
import warnings
from types import SimpleNamespace

import pytest

from megatron_dmuon.json_store import ForeignCacheFile
from megatron_dmuon.kernels.autotune import AutotuneCache
from megatron_dmuon.planning.caches import PlanCache, ProfileCache

CACHES = [(PlanCache, "DMUON_PLAN_CACHE", "owner plan cache"), (ProfileCache, "DMUON_PROFILE_CACHE", "NS profile cache"),
          (AutotuneCache, "DMUON_AUTOTUNE_CACHE", "autotune cache")]
FOREIGN = {
    "text": b"my notes\nline two\n",
    "json_list": b"[1, 2, 3]\n",
    "json_object": b'{"entries": [1], "owner": "me"}\n',
    "binary": bytes(range(256)),
}


def _state(directory):
    """Every file of ``directory``: its bytes and mode."""
    return {name: (open(os.path.join(directory, name), "rb").read(), stat.S_IMODE(os.stat(os.path.join(directory, name)).st_mode))
            for name in sorted(os.listdir(directory))}


@pytest.mark.parametrize("cls,env,label", CACHES, ids=[c[1] for c in CACHES])
def test_a_cache_pointed_at_a_file_that_is_not_ours_is_refused_and_left_untouched(tmp_path, monkeypatch, cls, env, label):
    """Before: 'unreadable; starting from an empty cache', then the file replaced (mode 0600)."""
    from megatron_dmuon.megatron.flags import check_cache_paths

    other = next(c for c in CACHES if c[0] is not cls)[0]  # another of DMuon's caches is not this one either
    other(tmp_path / "other_cache.json").put("k", {"a": 1})
    for name, data in FOREIGN.items():
        (tmp_path / name).write_bytes(data)
        os.chmod(tmp_path / name, 0o644)
    before = _state(tmp_path)
    for name in [*FOREIGN, "other_cache.json"]:
        path = tmp_path / name
        monkeypatch.setenv(env, str(path))
        args = SimpleNamespace(dmuon_autotune_cache=str(path) if env == "DMUON_AUTOTUNE_CACHE" else None)
        with pytest.raises(ValueError) as refused:  # at start-up, parse time (the main job and the hook)
            check_cache_paths(args)
        message = str(refused.value)
        assert message.startswith(f"the {cls.label} {path} is not a") and f" {cls.label} file (" in message, message
        assert label in cls.label
        assert "left untouched" in message and f"point ${env}" in message, message
        assert "a new file path" in message, message
        with pytest.raises(ForeignCacheFile, match="left untouched"):  # a direct write (or read) says the same
            cls(path).put("k", {"b": 2})
        with pytest.raises(ForeignCacheFile):
            cls(path).get("k")
    assert _state(tmp_path) == before  # bytes and modes unchanged, no temp or lock file beside them


def test_a_cache_of_ours_keeps_its_mode_and_link_and_a_cut_one_is_replaced_with_a_warning(tmp_path):
    path = tmp_path / "plans.json"
    PlanCache(path).put("a", {"x": 1})
    text = path.read_text()
    assert json.loads(text)["dmuon_cache"] == "megatron_dmuon owner plan cache" and text.startswith('{\n "dmuon_cache"')
    os.chmod(path, 0o640)
    PlanCache(path).put("b", {"x": 2})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640  # (0600 before: mkstemp's)
    # a file of ours cut short: a warning, then rebuilt (its mode kept)
    path.write_text(text[:25])
    with pytest.warns(RuntimeWarning, match="unreadable"):
        PlanCache(path).put("c", {"x": 3})
    assert set(PlanCache(path).entries) == {"c"} and stat.S_IMODE(os.stat(path).st_mode) == 0o640
    # written before the signature existed: still ours, read and signed at the next write
    legacy = tmp_path / "legacy.json"
    legacy.write_text(json.dumps({"entries": {"old": {"x": 0}}, "version": 1}, indent=1, sort_keys=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PlanCache(legacy).put("new", {"x": 4})
    assert set(json.loads(legacy.read_text())["entries"]) == {"old", "new"}
    # an empty file (mktemp) holds nothing to lose; a symlinked cache stays a link, its file updated
    empty = tmp_path / "empty.json"
    empty.write_text("")
    PlanCache(empty).put("k", {"x": 5})
    link = tmp_path / "link.json"
    link.symlink_to(path)
    PlanCache(link).put("d", {"x": 6})
    assert link.is_symlink() and set(PlanCache(path).entries) == {"c", "d"}


def test_dmuon_autotune_checks_its_cache_and_numbers_before_any_work(tmp_path, capsys):
    """Before: --steps 0 and an unknown --coefficients were taken; a --cache file that is not the
    autotune cache was found (and replaced) only after the first shape was tuned on the GPU."""
    from megatron_dmuon import cli

    foreign = tmp_path / "notes.json"
    foreign.write_text("[1]")
    for argv, message in ((["--cache", str(foreign)], f"the autotune cache {foreign} is not an autotune cache file "
                                                      "(it holds a JSON list; DMuon replaces only files it wrote: left "
                                                      "untouched): point --cache at a new file path"),
                          (["--steps", "0"], "--steps must be >= 1, got 0"),
                          (["--coefficients", "zz"], "--coefficients 'zz' unknown; valid: keller"),
                          (["--batches", "x"], "--batches must be positive integers, got 'x'")):
        assert cli.main(["autotune", "--shapes", "64x64", "--dry-run", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert foreign.read_text() == "[1]"


# ------------------------------------------------------------------------------- dmuon plan
def _plan_cli(capsys, argv):
    from megatron_dmuon import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", *argv])
    err = capsys.readouterr().err
    return exit_info.value.code, err


@pytest.mark.parametrize("content,message", [
    (None, "cannot be read (No such file or directory)"),
    ("", "is empty"),
    ("[1, 2]", "holds no DMuon plan (a JSON list without 'records')"),
    ('{"records": 5}', "holds a DMuon plan that does not read"),
    ('{"format": 1, "records": [], "layouts": [1], "settings": {}, "ranks_per_node": 1, "publish_dtype": "bf16"}',
     "holds a DMuon plan that does not read (AttributeError"),
], ids=["missing", "empty", "list", "records_int", "layouts_list"])
def test_dmuon_plan_show_of_a_file_without_a_plan_exits_2_with_one_line(tmp_path, capsys, content, message):
    """Before: exit 1 (a traceback for a plan whose layouts are a list)."""
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    code, err = _plan_cli(capsys, ["--show", str(path)])
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"dmuon plan: error: --show {path}: {message}") and "--timing-json" in err, err


def test_dmuon_plan_show_prints_a_good_plan_and_refuses_it_cut_short(tmp_path, capsys):
    from megatron_dmuon import cli
    from tests.planning.test_plan import _plan

    plan = _plan()
    path = tmp_path / "timing.json"
    path.write_text(json.dumps({"dmuon_plan": json.loads(plan.to_json())}))
    assert cli.main(["plan", "--show", str(path)]) == 0
    assert capsys.readouterr().out.strip() == plan.describe().strip()
    path.write_text(path.read_text()[:-40])
    code, err = _plan_cli(capsys, ["--show", str(path)])
    assert code == 2 and f"--show {path}: is not JSON (" in err and err.count("\n") == 1, err


ARGV = "--num-layers 2 --hidden-size 64 --num-attention-heads 4"


@pytest.mark.parametrize("argv,message", [
    (["--megatron-argv", ARGV], "--megatron-argv: the Megatron argv lacks --vocab-size (dmuon plan cannot run the "
                                "tokenizer to find it): add --vocab-size N"),
    (["--megatron-argv", ARGV + " --vocab-size 128 --data-path 'x"], "--megatron-argv: the command line does not "
                                                                      "split as a shell would (No closing quotation)"),
    (["--megatron-argv", ARGV.replace("2", "two") + " --vocab-size 128"],
     "--megatron-argv: argument --num-layers: invalid int value: 'two'"),
    (["--megatron-argv", ARGV + " --vocab-size 128 --tensor-model-parallel-size 0"],
     "--megatron-argv: --tensor-model-parallel-size must be >= 1 (got 0)"),
    (["--preset", "tiny", "--dp", "2", "--rank-model", "LIST"], "--rank-model LIST: holds a JSON list; give 'analytic'"),
    (["--preset", "tiny", "--dp", "2", "--rank-model", "NO_POINTS"], "holds no measured points ('jobs' is empty)"),
    (["--preset", "tiny", "--dp", "2", "--rank-model", "EMPTY_MODEL"], "holds no measured points (empty 'stacks'"),
    (["--preset", "tiny", "--dp", "2", "--rank-model", "NEGATIVE"],
     "the 'ms' of job 'ns|64x64|1' is -1.5: a measured time must be a finite number of ms >= 0"),
    (["--preset", "tiny", "--dp", "2", "--profile", "NEGATIVE_PROFILE"], "has the point (batch 1, -1.0 ms)"),
    (["--preset", "tiny", "--dp", "2", "--dmuon-coefficients", "bogus"], "--dmuon-coefficients: invalid choice"),
    (["--num-layers", "0", "--hidden", "64", "--heads", "4"], "--num-layers must be >= 1 (got 0)"),
    ([], "no model: give --preset, --megatron-argv, or --num-layers/--hidden/--heads"),
    (["--preset", "tiny", "--dp", "2", "--experts", "3"], "the shape flags --experts would be ignored with --preset"),
    (["--preset", "tiny", "--dp", "2", "--ep", "2"], "--ep 2: expert parallelism needs a MoE model"),
    (["--preset", "tiny-moe", "--dp", "2", "--ep", "3"], "--ep 3 must divide the model's 4 experts"),
    (["--preset", "tiny", "--megatron-argv", "x"], "--preset and --megatron-argv both describe the model"),
], ids=["argv_no_vocab", "argv_quote", "argv_int", "argv_tp0", "rank_list", "rank_no_points", "rank_empty_model", "rank_negative",
        "profile_negative", "coefficients", "num_layers_0", "no_model", "shape_with_preset", "ep_on_dense",
        "ep_not_dividing_experts", "preset_and_argv"])
def test_dmuon_plan_refuses_bad_model_files_and_argv_by_flag(tmp_path, capsys, argv, message):
    """Before: tracebacks (--rank-model list / negative time, --megatron-argv without --vocab-size or
    with an open quote, TP 0 inside it), or a plan on nonsense (no points, an unknown schedule)."""
    files = {"LIST": [1, 2], "NO_POINTS": {"jobs": {}},
             "EMPTY_MODEL": {"format": 1, "stacks": {}, "adamw": [], "shared_ms": 0, "hidden": 0},
             "NEGATIVE": {"jobs": {"ns|64x64|1": {"ms": -1.5}}},
             "NEGATIVE_PROFILE": {"meta": {}, "points": {"64x64": [[1, -1.0], [2, 1.0]]}}}
    for name, data in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    argv = [str(tmp_path / f"{a}.json") if a in files else a for a in argv]
    message = message.replace("LIST", str(tmp_path / "LIST.json"))
    code, err = _plan_cli(capsys, argv)
    assert code == 2 and err.count("\n") == 1 and message in err, err
