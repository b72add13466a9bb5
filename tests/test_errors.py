"""fedjax_split.errors: the one-line form every command line reports a UserError in."""

from __future__ import annotations

from fedjax_split.errors import UserError, report


def test_report_prints_one_line_to_stderr_and_returns_status_2(capsys) -> None:
    assert report(UserError("unknown task 'sst3'; use one of sst2, mrpc")) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "error: unknown task 'sst3'; use one of sst2, mrpc\n"


def test_user_errors_are_ordinary_value_errors() -> None:
    from fedjax_split.tasks.registry import get_task

    try:
        get_task("sst3")
    except ValueError as e:  # what a library user catches, without knowing our type
        assert isinstance(e, UserError) and "unknown task" in str(e)
    else:
        raise AssertionError("no error for an unknown task")
