"""Where the daemon lives and how it is started and stopped without systemd.

- :func:`default_socket_path`: ``$XDG_RUNTIME_DIR/offloadctl/tuner.sock``, or
  ``/run/offloadctl/tuner.sock`` for root;
- :func:`default_db_path`: ``$XDG_STATE_HOME/offloadctl/tuner.db`` (``~/.local/state/...``):
  history must outlive a reboot, so not under the runtime directory (a tmpfs);
- :func:`start` / :func:`stop` / :func:`status`: a detached ``offloadctl tuner serve`` with a
  pidfile and a log file next to the socket (:func:`write_pid`, :func:`read_pid` and
  :func:`release_pid` are the pidfile's only reader and writers; ``_tail``, the log's only reader);
- :func:`ensure_daemon`: what ``offloadctl train --tuner auto`` calls: the running daemon, or a
  private one for the run;
- the registry of live runs (:func:`registry_dir`, :func:`register_run`, :func:`live_runs`): a
  private daemon writes one file there while it serves, so ``offloadctl tune`` finds runs whose
  sockets live in their run directories.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any, Callable

from engine.errors import ConfigError
from tuner.own_files import open_own, shared_dir_problem
from tuner.protocol import Connection, ProtocolError

if TYPE_CHECKING:
    from tuner.run_state import RunView


def default_socket_path() -> str:
    if os.geteuid() == 0:
        return "/run/offloadctl/tuner.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.geteuid()}"
    if not os.path.isdir(runtime):  # no login session (a batch job): a private directory in /tmp
        runtime = os.path.join(tempfile.gettempdir(), f"offloadctl-{os.geteuid()}")
    return os.path.join(runtime, "offloadctl", "tuner.sock")


def default_db_path() -> str:
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "offloadctl", "tuner.db")


def registry_dir() -> str:
    """Where this user's private daemons list themselves: ``$XDG_RUNTIME_DIR/offloadctl/runs``,
    else ``runs`` next to the default socket. Runtime state: gone at reboot with the daemons."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "offloadctl", "runs")
    return os.path.join(os.path.dirname(default_socket_path()), "runs")


def register_run(socket_path: str, run_dir: str, pid: int | None = None, run_id: str | None = None) -> str:
    """List the daemon ``pid`` (default: this process) serving ``run_dir`` (the run ``run_id``,
    when known: ``tune`` finds it by that id before its ranks register) at ``socket_path``;
    the entry's path, for :func:`unregister_run`."""
    pid = pid or os.getpid()
    d = private_dir(registry_dir())
    entry = os.path.join(d, f"{pid}.json")
    tmp = f"{entry}.tmp"
    with open(tmp, "w") as f:
        json.dump(
            {
                "pid": pid,
                "socket": os.path.abspath(socket_path),
                "run_dir": os.path.abspath(run_dir),
                "started_at": time.time(),
                "run_id": run_id,
            },
            f,
        )
    os.replace(tmp, entry)  # a reader never sees half an entry
    return entry


def unregister_run(entry: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(entry)


def live_runs() -> list[dict[str, Any]]:
    """This user's private daemons that are alive, oldest first: ``pid``, ``socket``,
    ``run_dir``, ``started_at``. Entries of daemons that died without removing theirs (SIGKILL,
    a crash) are deleted on the way."""
    d = registry_dir()
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return []
    out = []
    for name in names:
        if not name.endswith(".json"):
            continue
        path = os.path.join(d, name)
        try:
            with open(path) as f:
                entry = json.load(f)
            pid = int(entry["pid"])
            alive = pid_alive(pid) and _is_our_daemon(pid) and os.path.exists(entry["socket"])
        except (OSError, ValueError, KeyError, TypeError):
            alive = False
        if not alive:
            unregister_run(path)
            continue
        out.append(entry)
    return sorted(out, key=lambda e: e.get("started_at") or 0)


def pidfile_for(socket_path: str) -> str:
    return socket_path + ".pid"


def logfile_for(socket_path: str) -> str:
    return socket_path + ".log"


def endedfile_for(socket_path: str) -> str:
    """The daemon's record of the runs that ended (their final views, by run id)."""
    return socket_path + ".ended.json"


def read_ended(socket_path: str) -> dict[str, RunView]:
    """``{run_id: final view}`` of the runs that ended at the daemon of ``socket_path``, oldest
    first; {} when there is no such record (yet)."""
    try:
        with open(endedfile_for(socket_path)) as f:
            ended = json.load(f)
    except (OSError, ValueError):
        return {}
    return ended if isinstance(ended, dict) else {}


def private_dir(path: str) -> str:
    """Create ``path`` (mode 0700) if missing. Refuse it if it, or the directory holding it,
    belongs to another user (they could swap the socket for their own: a /tmp trap), or if other
    users may write in it (they could put links there for the daemon's log, pidfile or history:
    :mod:`tuner.own_files`)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    for d, allowed in ((path, (os.geteuid(),)), (os.path.dirname(os.path.abspath(path)), (os.geteuid(), 0))):
        uid = os.stat(d).st_uid
        if uid not in allowed:
            raise ConfigError(f"{d} belongs to uid {uid}, not to you: pick another --socket")
    problem = shared_dir_problem(path)
    if problem:
        raise ConfigError(
            f"{problem}: they could put links there for the tuner daemon's log, pidfile or history; pick "
            f"a --socket in a directory only you can write (mode 0700)"
        )
    return path


def probe(socket_path: str, timeout_s: float = 2.0) -> dict[str, Any] | None:
    """The daemon's ``welcome`` (pid, version, server_id), or None when nothing answers."""
    try:
        with Connection(socket_path, timeout_s=timeout_s) as c:
            return c.welcome
    except (OSError, ProtocolError, ValueError):
        return None


def status(socket_path: str | None = None) -> dict[str, Any]:
    """Whether a daemon answers at the socket, and what it serves."""
    path = socket_path or default_socket_path()
    out = {"socket": path, "running": False, "pidfile": pidfile_for(path), "log": logfile_for(path)}
    try:
        with Connection(path, timeout_s=2.0) as c:
            snap = c.request("snapshot", history=0)
    except (OSError, ProtocolError, ValueError) as e:
        out["reason"] = str(e)
        return out
    d = snap["daemon"]
    out.update(
        running=True,
        pid=d["pid"],
        version=d["version"],
        api=d["api"],
        uptime_s=d["uptime_s"],
        connections=d["connections"],
        socket_activated=d["socket_activated"],
        runs=[{k: r[k] for k in ("run_id", "status", "ranks", "connected", "iteration", "iter_time_s")} for r in snap["runs"]],
    )
    return out


def run_view(socket_path: str, run_id: str) -> RunView | None:
    """The daemon's view of one run (``tuner.run_state.run_view``: its knobs, where they
    started, who changed each, the policy's state), for the end of ``offloadctl train``; None
    when the daemon does not answer or knows no such run."""
    try:
        with Connection(socket_path, timeout_s=2.0) as c:
            snap = c.request("snapshot", run_id=run_id, history=0)
    except (OSError, ProtocolError, ValueError):
        return None
    return next((r for r in snap["runs"] if r["run_id"] == run_id), None)


def start(
    socket_path: str | None = None,
    *,
    db_path: str | None = None,
    timeout_s: float = 30.0,
    extra_args: tuple[str, ...] = (),
    owned: bool = False,
) -> dict[str, Any]:
    """Start a detached daemon at the socket (idempotent); return its pid, socket and log.
    ``owned``: a private daemon of this process, which stops when this process is gone, however
    it ends (a parent-death signal, and its own check of this pid)."""
    path = os.path.abspath(socket_path or default_socket_path())
    welcome = probe(path)
    if welcome is not None:
        return {"socket": path, "pid": welcome["pid"], "log": logfile_for(path), "already_running": True}
    log_fix = "remove it, or pick a --socket in a directory only you can write (mode 0700)"
    try:
        private_dir(os.path.dirname(path))
        if db_path != "none":  # refused here, in one line, rather than in the daemon's log
            from tuner.history import check_db_place

            check_db_place(db_path or default_db_path())
        log_fd = open_own(logfile_for(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, "tuner log", log_fix)
    except OSError as e:
        why = {
            errno.EROFS: "the file system is read-only",
            errno.EEXIST: "a part of the path is a file",
            errno.ENOTDIR: "a part of the path is a file",
            errno.EACCES: "permission denied",
            errno.ELOOP: "a symbolic link loop",
        }.get(e.errno or 0, e.strerror or str(e))
        raise ConfigError(
            f"tuner socket {path}: cannot make it there ({why}): give --socket a path in a directory you can write"
        ) from None
    cmd = [
        sys.executable,
        "-m",
        "offloadctl.cli",
        "tuner",
        "serve",
        "--socket",
        path,
        "--db",
        db_path or default_db_path(),
        "--pidfile",
        pidfile_for(path),
        *extra_args,
    ]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    # A new session: the daemon outlives this command and ignores its terminal's signals.
    if owned:
        cmd += ["--owner-pid", str(os.getpid())]
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=log_fd,
            cwd="/",
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent if owned else None,
        )
    finally:
        os.close(log_fd)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigError(
                f"the tuner daemon exited with status {proc.returncode} at start: see "
                f"{logfile_for(path)}: {_tail(logfile_for(path))}"
            )
        welcome = probe(path, timeout_s=1.0)
        if welcome is not None and welcome["pid"] == proc.pid:
            return {"socket": path, "pid": proc.pid, "log": logfile_for(path), "already_running": False, "process": proc}
        time.sleep(0.05)
    why = _no_answer(path)
    proc.kill()  # a daemon no client would talk to is no use; and this command says it failed
    proc.wait()
    raise ConfigError(
        f"the tuner daemon did not answer at {path} within {timeout_s:g} s ({why}), and was stopped: see {logfile_for(path)}"
    )


def _no_answer(path: str) -> str:
    """Why nothing answers at the socket ``path``: the client's own words."""
    try:
        with Connection(path, timeout_s=1.0):
            return "it answered only now"
    except (OSError, ProtocolError, ValueError) as e:
        return " ".join(str(e).split())[:300]


def stop(socket_path: str | None = None, *, timeout_s: float = 10.0) -> dict[str, Any]:
    """Ask the daemon to shut down; SIGTERM it if it does not; remove its pidfile."""
    path = os.path.abspath(socket_path or default_socket_path())
    pidfile = pidfile_for(path)
    welcome = probe(path)
    pid = welcome["pid"] if welcome else read_pid(pidfile)
    if welcome is not None:
        with contextlib.suppress(OSError, ProtocolError):
            with Connection(path, timeout_s=2.0) as c:
                c.request("shutdown")
    stopped = pid is not None and _wait_exit(pid, timeout_s / 2)
    if pid is not None and not stopped and _is_our_daemon(pid):
        os.kill(pid, signal.SIGTERM)
        stopped = _wait_exit(pid, timeout_s / 2)
        if not stopped:
            raise ConfigError(f"the tuner daemon (pid {pid}) did not exit on SIGTERM: kill it with `kill -9 {pid}`")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(pidfile)
    return {"socket": path, "pid": pid, "was_running": welcome is not None or stopped}


def ensure_daemon(
    socket_path: str | None = None, *, run_dir: str | None = None, run_id: str | None = None
) -> tuple[str, Callable[[], None] | None]:
    """``(socket_path, stop)`` for a run: a daemon that answers at ``socket_path`` (default:
    :func:`default_socket_path`) with ``stop=None``, else a private daemon started for this run
    (under ``run_dir``, or a temporary directory when that path is too long for a socket; listed
    with ``run_id``), whose ``stop()`` shuts it down."""
    path = socket_path or default_socket_path()
    if probe(path) is not None:
        return path, None
    base = os.path.abspath(run_dir) if run_dir else ""
    scratch = not base or len(os.fsencode(os.path.join(base, "tuner", "tuner.sock"))) >= 100
    if scratch:
        base = tempfile.mkdtemp(prefix="offloadctl-")
    own = os.path.join(private_dir(os.path.join(base, "tuner")), "tuner.sock")
    extra = ("--run-dir", os.path.abspath(run_dir)) if run_dir else ()
    info = start(own, owned=True, extra_args=extra + (("--run-id", run_id) if run_dir and run_id else ()))
    proc = info.get("process")

    def stop_private() -> None:
        stop(own)
        if proc is not None:
            proc.wait(5)  # reap it: the daemon is our child
        if scratch:
            shutil.rmtree(base, ignore_errors=True)

    return own, stop_private


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the daemon's own check of its owner's pid still stops it
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _tail(path: str, n: int = 400) -> str:
    """The last line of the log at ``path`` (within its last ``n`` bytes), for an error line."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - n))
            return f.read().decode(errors="replace").strip().splitlines()[-1]
    except (OSError, IndexError):
        return "(no log)"


def write_pid(pidfile: str) -> None:
    """Write this process's pid to ``pidfile``, atomically: a reader never sees half of it."""
    tmp = f"{pidfile}.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # left by an earlier process of this pid
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(tmp, pidfile)


def release_pid(pidfile: str) -> None:
    """Remove ``pidfile`` if it holds this process's pid: a daemon that lost the race for the
    socket leaves the winner's."""
    if read_pid(pidfile) == os.getpid():
        os.unlink(pidfile)


def read_pid(pidfile: str) -> int | None:
    """The pid a daemon wrote to ``pidfile``; None when there is none to read."""
    try:
        with open(pidfile) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def daemon_stopped(socket_path: str) -> bool:
    """Whether the daemon of ``socket_path`` was up (its pidfile written) and is gone without
    taking its pidfile with it (killed, crashed); False for one that has not started yet."""
    pid = read_pid(pidfile_for(socket_path))
    return pid is not None and not (pid_alive(pid) and _is_our_daemon(pid))


def _is_our_daemon(pid: int) -> bool:
    """Whether ``pid`` is an ``offloadctl tuner serve`` (not a reused pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return b"tuner" in argv and b"serve" in argv


def _wait_exit(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            done, _ = os.waitpid(pid, os.WNOHANG)  # our child (ensure_daemon): reap it
            if done:
                return True
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return not pid_alive(pid)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited. A zombie (exited, not yet reaped by
    its parent) is not alive: a daemon's owner that exited is gone even before it is reaped."""
    if pid <= 0:
        return False  # kill() would signal a process group, and succeed
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return not os.path.exists("/proc/self")  # reaped since kill(); or no /proc here to tell a zombie
    except (OSError, IndexError):
        return True  # it exists (kill said so); its state cannot be read
    return state != "Z"
