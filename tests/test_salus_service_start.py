"""`accelopt serve | submit | status` refusing what cannot start: a socket path too long for a
Unix socket, a bad flag. Each is one line (exit 2), and a refused serve leaves nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from accelopt import UserError

pytestmark = pytest.mark.timeout(60)


def long_socket(base: Path) -> Path:
    """A socket path over the Unix-socket limit (107 bytes on Linux, 103 elsewhere), in a
    directory not yet made, its name short enough for the file system."""
    path = base / "sockets" / ("s" * max(8, 130 - len(str(base))))
    assert len(str(path)) > 107 and len(path.name) < 200
    return path


@pytest.mark.parametrize("command", [
    ["serve"],
    ["submit", "model=mlp", "iterations=2"],
    ["status"],
    ["cancel", "001-x"],
    ["serve", "--stop"],
])
def test_a_socket_path_too_long_is_one_line_and_the_serve_makes_nothing(tmp_path, command):
    """``AF_UNIX path too long`` was reported as a crash of the plugin (exit 1), and the
    refused serve had made the socket's directory and ``<root>/jobs``."""
    from accelopt.cli.main import dispatch

    sock = long_socket(tmp_path)
    with pytest.raises(UserError) as info:
        dispatch([*command, "--socket", str(sock), *(
            ["--root", str(tmp_path / "root")] if command == ["serve"] else [])], False)
    line = str(info.value)
    assert info.value.exit_code == 2 and "\n" not in line
    assert "byte limit of a Unix socket path; pass a shorter --socket or " \
           "$ACCELOPT_SALUS_SOCKET" in line
    assert list(tmp_path.iterdir()) == []


def test_a_socket_path_too_long_from_the_environment_is_one_line(tmp_path, monkeypatch):
    from accelopt.cli.main import dispatch

    monkeypatch.setenv("ACCELOPT_SALUS_SOCKET", str(long_socket(tmp_path)))
    with pytest.raises(UserError, match=r"over the 10\d-byte limit of a Unix socket path; "
                                        r"pass a shorter --socket or \$ACCELOPT_SALUS_SOCKET"):
        dispatch(["status"], False)


def test_a_socket_path_at_the_limit_is_taken(tmp_path):
    """The check refuses only what a socket cannot take: a path of exactly the limit binds."""
    import socket

    from accelopt_plugins.salus.service import SOCKET_PATH_MAX, check_socket_path

    path = tmp_path / ("s" * max(1, SOCKET_PATH_MAX - len(str(tmp_path)) - 1))
    assert len(str(path)) == SOCKET_PATH_MAX
    check_socket_path(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
    with pytest.raises(UserError):
        check_socket_path(Path(str(path) + "s"))


@pytest.mark.parametrize("flags", [
    ["--capacity", "abc"],
    ["--device", "tpu"],
    ["--threads", "-3"],
    ["--max-lanes", "-5"],
    ["--policy", "bogus"],
])
def test_a_serve_refused_for_a_bad_flag_makes_nothing(tmp_path, flags):
    """``--capacity abc`` (or ``--device tpu``, ``--threads -3``) was refused after
    ``<root>/jobs`` and the socket's directory had been made: every option is checked
    before anything is written."""
    from accelopt_plugins.salus.cli import serve_cmd

    with pytest.raises(UserError) as info:
        serve_cmd(["--socket", str(tmp_path / "run" / "s.sock"), "--root",
                   str(tmp_path / "root"), *flags])
    assert "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []
