"""stop_process's decision for an already reaped leader (host/netns.py `leftover_group`)."""

from __future__ import annotations

from pathlib import Path

from ambient_mesh.host.netns import leftover_group, process_group_members


def _stat(proc: Path, pid: int, pgrp: int, comm: str = "x") -> None:
    (proc / str(pid)).mkdir()
    (proc / str(pid) / "stat").write_text(f"{pid} ({comm}) S 1 {pgrp} {pgrp} 0 -1 4194560 0\n")


def test_members_come_from_the_pgrp_field_even_with_spaces_and_parens_in_comm(tmp_path):
    _stat(tmp_path, 10, 10)
    _stat(tmp_path, 11, 10, comm="a) S 1 99 (b")
    _stat(tmp_path, 12, 7)
    (tmp_path / "self").mkdir()
    assert sorted(process_group_members(10, tmp_path)) == [10, 11]
    assert process_group_members(99, tmp_path) == []


def test_a_group_with_a_member_whose_pid_is_the_group_id_is_a_new_group():
    assert not leftover_group(100, [100, 101])  # pid 100 was reused by a setsid() process
    assert not leftover_group(100, [])  # nothing left
    assert leftover_group(100, [101, 102])  # the reaped leader's children
