"""The socket a front end serves on: bound (so reserved) before anything slow starts, and handed from parent to
child by file descriptor. The last tests run real workers: one on a socket its parent bound, one whose port is
taken, and ``up`` with its port taken."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from entrypoints import cli
from entrypoints.arguments import build_parser
from entrypoints.http.listener import address, bound_socket, inherited_socket
from tests.waiting import eventually

REPO = Path(__file__).resolve().parents[3]


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}


def test_a_bound_socket_holds_its_port_against_other_binds_and_refuses_connections_until_it_listens() -> None:
    with bound_socket("127.0.0.1", 0) as reserved:
        host, port = address(reserved)
        assert (host, port != 0) == ("127.0.0.1", True)
        for reuse_address in (0, 1):  # a server binding as uvicorn does (SO_REUSEADDR) is kept out as well
            with socket.socket() as other, pytest.raises(OSError) as taken:
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, reuse_address)
                other.bind(("127.0.0.1", port))
            assert taken.value.errno == errno.EADDRINUSE
        with socket.socket() as client, pytest.raises(ConnectionRefusedError):
            client.connect(("127.0.0.1", port))
        reserved.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass


def test_reuse_port_lets_several_front_ends_bind_one_port() -> None:
    first = bound_socket("127.0.0.1", 0, reuse_port=True)
    with first, bound_socket("127.0.0.1", address(first)[1], reuse_port=True) as second:
        assert address(second) == address(first)


def _serving_socket() -> socket.socket:
    """A port some other server already listens on."""
    return socket.create_server(("127.0.0.1", 0))


def test_a_port_in_use_raises_at_bind_and_leaves_no_socket_open() -> None:
    with _serving_socket() as reserved:
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(OSError) as taken:
            bound_socket("127.0.0.1", address(reserved)[1])
        assert taken.value.errno == errno.EADDRINUSE
        assert len(os.listdir("/proc/self/fd")) == before


def test_an_inherited_socket_is_the_parents_socket_and_is_not_passed_on() -> None:
    with bound_socket("127.0.0.1", 0) as parent:
        duplicate = os.dup(parent.fileno())
        os.set_inheritable(duplicate, True)
        with inherited_socket(duplicate) as child:
            assert address(child) == address(parent)
            assert not child.get_inheritable()


def test_what_is_not_a_bound_tcp_socket_is_refused_by_name() -> None:
    closed = os.dup(0)
    os.close(closed)
    with pytest.raises(ValueError, match=f"--listen-fd {closed}: not an open socket"):
        inherited_socket(closed)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.bind(("127.0.0.1", 0))
        with pytest.raises(ValueError, match="not a TCP socket"):
            inherited_socket(udp.fileno())
    with socket.socket() as unbound, pytest.raises(ValueError, match="not bound"):
        inherited_socket(unbound.fileno())
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(ValueError, match="not an open socket"):
            inherited_socket(read_end)
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_socket_handed_over_serves_one_front_end() -> None:
    # A process of its own: ``main`` sets up the root logger, which must not change under the rest of the suite.
    with bound_socket("127.0.0.1", 0) as handed:
        done = subprocess.run([sys.executable, "-m", "entrypoints.cli", "worker", "--engine", "synthetic",
                               "--api-workers", "2", "--port", str(address(handed)[1]),
                               "--listen-fd", str(handed.fileno())],
                              cwd=REPO, env=_clean_env(), pass_fds=(handed.fileno(),), capture_output=True,
                              text=True, timeout=120)
    assert done.returncode == 2
    assert "--listen-fd serves one front end (--api-workers 1)" in done.stderr


def test_a_forked_child_of_a_server_does_not_keep_its_port() -> None:
    """vLLM forks its engine core without exec: the child closes its copy of the socket at once."""
    listener = cli._listener(build_parser().parse_args(["worker", "--port", "0"]), "127.0.0.1", 0)
    assert listener is not None
    with listener:
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:  # the child: report whether its copy is closed, and leave without running anything else
            os.write(write_end, b"closed" if listener.fileno() == -1 else b"open")
            os._exit(0)
        os.close(write_end)
        try:
            assert os.read(read_end, 16) == b"closed"
        finally:
            os.close(read_end)
            os.waitpid(child, 0)
        assert listener.fileno() != -1  # the parent's is untouched


def _worker(*argv: str, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "entrypoints.cli", "--log-level", "warning", "worker", "--engine", "synthetic",
               *argv]
    return subprocess.Popen(command, cwd=REPO, env=_clean_env(), pass_fds=pass_fds, stderr=subprocess.PIPE)


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.stderr is not None:
        process.stderr.close()


def test_a_worker_serves_on_the_socket_its_parent_bound() -> None:
    with bound_socket("127.0.0.1", 0) as handed:
        port = address(handed)[1]
        process = _worker("--listen-fd", str(handed.fileno()), "--port", str(port), pass_fds=(handed.fileno(),))
    try:
        def healthy() -> bool:
            if process.poll() is not None:
                return True  # exited: fail below
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            return False

        assert eventually(healthy, timeout_s=120, every_s=0.1)
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
    finally:
        _stop(process)


def test_a_worker_whose_port_is_taken_says_so_and_exits_with_the_start_up_status() -> None:
    with _serving_socket() as taken:
        port = address(taken)[1]
        process = _worker("--port", str(port))
        try:
            assert process.wait(timeout=120) == 3
            assert process.stderr is not None
            assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in process.stderr.read().decode()
        finally:
            _stop(process)


def test_up_with_its_port_taken_exits_at_once_and_starts_nothing() -> None:
    with _serving_socket() as taken:
        port = address(taken)[1]
        done = subprocess.run([sys.executable, "-m", "entrypoints.cli", "up", "--engine", "synthetic", "--port",
                               str(port)], cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"disagg-serve up: cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "starting CTX" not in done.stdout
