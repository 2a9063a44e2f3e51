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
