"""The soak's ``--mode`` spelling: comma-joined dimensions, each with a default."""

from __future__ import annotations

import pytest

from tests.soak.spec import Mode, parse_mode, parse_modes


def test_dimensions_combine_and_the_others_keep_their_defaults() -> None:
    mode = parse_mode("untracked, shards16,dense")
    assert mode == Mode(workers="untracked", tasks="plain", shards=16, dense=True)
    assert mode.name == "untracked,shards16,dense"
    assert mode.one_off_tasks == ("soak.plain",)
    assert set(mode.periodic) == {"soak-plain-2s", "soak-plain-5s"}
    assert parse_mode("clients").name == "tracked,clients"
    assert parse_mode("task").periodic.keys() == {"soak-task-3s", "soak-task-5s"}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("untracked,task", "plain tasks only"),
        ("tracked,untracked", "both workers"),
        ("shards16,shards2", "both shards"),
        ("dense,,clients", "empty dimension"),
        ("shards0", "1..256"),
        ("fast", "unknown dimension 'fast'"),
    ],
)
def test_a_bad_mode_names_its_fault(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_mode(text)


def test_all_runs_each_mode_once() -> None:
    names = [mode.name for mode in parse_modes(["all", "tracked"])]
    assert names == [
        "tracked",
        "untracked",
        "tracked,plain",
        "tracked,task",
        "tracked,shards16",
        "tracked,dense",
        "tracked,clients",
    ]
    assert parse_modes([]) == [Mode()]
