"""<run_dir>/logs/ray links the Ray session's logs. A run directory started again (resume=, or any reuse) after its
earlier session's files were removed (a reboot clears /tmp/ray) holds a dangling link: it is replaced, not a crash."""

from __future__ import annotations

from lightning_ray.services import _link_ray_logs


def test_the_link_follows_the_current_session_even_when_the_earlier_one_is_gone(tmp_path):
    old, new = tmp_path / "session_old", tmp_path / "session_new"
    (new / "logs").mkdir(parents=True)
    (tmp_path / "run" / "logs").mkdir(parents=True)
    (tmp_path / "run" / "logs" / "ray").symlink_to(old / "logs", target_is_directory=True)  # dangling
    _link_ray_logs(str(new), tmp_path / "run" / "logs")
    assert (tmp_path / "run" / "logs" / "ray").resolve() == (new / "logs").resolve()
    _link_ray_logs(str(new), tmp_path / "run" / "logs")  # and again: idempotent
    assert (tmp_path / "run" / "logs" / "ray").resolve() == (new / "logs").resolve()
