"""The main job's start-up checks run in the test's own process (as launch/run_main.sh's --parse-only
runs them), for the tests of refused command lines."""
from __future__ import annotations


def main_job_refusal(argv, capsys) -> str:
    """The one usage error the main job's checks give for ``argv`` (exit 2, one 'error:' line): its
    message after 'error: '."""
    import pytest

    from megatron_dmuon.megatron.train.args import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args([str(a) for a in argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("error:") == 1, err
    return err.split("error: ", 1)[1].strip()


def as_one_process(monkeypatch, tmp_path) -> None:
    """The test process as a one-GPU job without torchrun's environment, its caches under ``tmp_path``
    (never the user's)."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DMUON_PLAN_CACHE", str(tmp_path / "plans.json"))
    monkeypatch.setenv("DMUON_PROFILE_CACHE", str(tmp_path / "profile.json"))
    monkeypatch.setenv("DMUON_AUTOTUNE_CACHE", str(tmp_path / "tune.json"))
