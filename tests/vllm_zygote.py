"""A vLLM interpreter that has already imported the API server, and forks one server per request (the tests only).

A server start imports the API server, ~11 of its ~17 CPU-s on CPU (bench/server_start_forked.py), at each of the
suite's ~27 starts. test.sh runs one zygote for the whole suite; ``tests/vllm_python`` asks it for each
``-m vllm.entrypoints.openai.api_server`` it is given, and starts a fresh interpreter as before when there is no
zygote or it declines.

    vllm_zygote.py serve SOCKET         the zygote (test.sh, in the background; it ends with its parent)
    vllm_zygote.py run MODULE ARGS...   the door: what ``python -m MODULE ARGS...`` would be, forked by the zygote

The door stands where the server's process would: it is the process its launcher started, in the launcher's process
group, with its stdin/stdout/stderr (passed to the zygote over the socket), and it exits as the server does (status
or signal). SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 sent to the door go to the server's process group
(the server and its engine); when the door dies by SIGKILL the zygote kills that group. What the door cannot carry
is the process group itself: the server runs in a group of its own beside the door's, so a test about the server's
process group (test_server_lifecycle.py) starts its server fresh, with EAGLE3PIPE_VLLM_ZYGOTE empty.

The server sees the door's environment, working directory and umask. A variable that is read when a module is
imported (OMP_NUM_THREADS, HF_HUB_OFFLINE, VLLM_LOGGING_LEVEL, ...) would keep the zygote's value, so the zygote
declines a request whose environment differs from its own in any variable but those vLLM reads at run time
(RUN_TIME_VARIABLES), and says which one.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys

ZYGOTE_ENV = "EAGLE3PIPE_VLLM_ZYGOTE"  # the socket's path (test.sh); empty or unset: no zygote
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# Variables that may differ between the zygote and a server: read by vLLM when the server runs (vllm.envs reads
# lazily; the launcher sets these), by pytest about the current test, or PYTHONPATH (applied to sys.path below).
RUN_TIME_VARIABLES = {"VLLM_HOST_IP", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK", "VLLM_CPU_KVCACHE_SPACE",
                      "VLLM_API_KEY", "VLLM_WORKER_MULTIPROC_METHOD", "PYTHONPATH",
                      "TORCHINDUCTOR_CACHE_DIR",  # read by torch each time it looks for the cache
                      "COLUMNS", "LINES",  # pytest's terminal size, read when asked (shutil.get_terminal_size)
                      "CONFIG", "DEMO_SKIP_SETUP",  # demo.sh's settings, read by no module
                      "PWD", "OLDPWD", "SHLVL", "_"}  # a shell's, read by no module
# pytest's and xdist's about the current test; ours (vLLM reads none); wandb's, read when a run starts (a test
# process that logged to wandb keeps WANDB_SERVICE)
RUN_TIME_PREFIXES = ("PYTEST_", "EAGLE3PIPE_", "WANDB_")
STARTING_WAIT_S = 120.0  # a door waits this long for a zygote still importing (its socket bound, not yet renamed)


# ---------------------------------------------------------------------------------------------------------------
# the door


def run(argv: list[str]) -> None:
    """``python -m argv[0] argv[1:]``, forked by the zygote; a fresh interpreter when there is none or it declines."""
    import time

    path = os.environ.get(ZYGOTE_ENV, "")
    waited = 0.0
    while path and not os.path.exists(path) and os.path.exists(path + ".tmp") and waited < STARTING_WAIT_S:
        time.sleep(0.2)  # the zygote is importing; a fresh interpreter would import beside it on the same cores
        waited += 0.2
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:  # no zygote
        start_fresh(argv)
    send_request(conn, argv, dict(os.environ), os.getcwd())
    replies = conn.makefile("r")
    answer = replies.readline().split(" ", 1)
    if answer[0] != "pid":
        print(f"vllm_zygote: a fresh interpreter ({answer[-1].strip() or 'the zygote did not answer'})",
              file=sys.stderr, flush=True)
        start_fresh(argv)
    server = int(answer[1])
    for sig in RELAYED:
        signal.signal(sig, lambda sig, _frame: _signal_group(server, sig))
    status = replies.readline().split()
    status = int(status[1]) if len(status) == 2 and status[0] == "exit" else None
    if status is None:  # the zygote died before the server: the server died with it (PR_SET_PDEATHSIG)
        print("vllm_zygote: the zygote ended before the server's exit status came", file=sys.stderr, flush=True)
        os._exit(1)
    if os.WIFSIGNALED(status):  # die as the server died
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


def send_request(conn: socket.socket, argv: list[str], env: dict[str, str], cwd: str) -> None:
    """Ask for ``python -m argv[0] argv[1:]`` with this environment and directory, on this process's stdio; the
    zygote answers ``pid N`` (then ``exit STATUS``) or ``fresh REASON``."""
    umask = os.umask(0)
    os.umask(umask)
    request = json.dumps({"argv": argv, "env": env, "cwd": cwd, "umask": umask}).encode()
    socket.send_fds(conn, [struct.pack(">I", len(request)) + request], [0, 1, 2])


def start_fresh(argv: list[str]) -> None:
    """What tests/vllm_python does without a zygote (this interpreter is .venv-vllm's)."""
    fork_server = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_fork_server.py")
    os.execv(sys.executable, [sys.executable, fork_server, *argv])


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------------------------------------------------
# the zygote


def serve(path: str) -> None:
    """Import the API server once, then fork a server for each request on ``path`` until the parent (test.sh) ends."""
    parent = os.getppid()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # test.sh's kill: clean up below
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")  # renamed once imported: doors wait while only the .tmp name exists
    listener.listen(16)
    environ = dict(os.environ)
    import vllm_fork_server  # noqa: F401  the tests' patches: the engine by fork, model inspection in process
    import vllm.entrypoints.openai.api_server  # noqa: F401  the ~11 CPU-s each server would import again

    # what importing did to the environment, which a fresh interpreter's imports would do again
    imported = {name: os.environ.get(name) for name in set(environ) | set(os.environ)
                if environ.get(name) != os.environ.get(name)}
    os.replace(path + ".tmp", path)
    print(f"vllm_zygote: ready at {path} (pid {os.getpid()})", flush=True)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    servers: dict[int, socket.socket] = {}  # server pid -> its door's connection
    try:
        while os.getppid() == parent:
            for key, _ in selector.select(timeout=1.0):
                if key.fileobj is listener:
                    conn = listener.accept()[0]
                    pid = _answer(conn, environ, imported, selector, listener, servers)
                    if pid:
                        servers[pid] = conn
                        selector.register(conn, selectors.EVENT_READ, pid)
                    else:
                        conn.close()
                elif not _recv_or_reset(key.fileobj):  # the door is gone (SIGKILL): so is its server
                    selector.unregister(key.fileobj)
                    _signal_group(key.data, signal.SIGKILL)
                    print(f"vllm_zygote: server {key.data} killed: its door is gone", flush=True)
            _reap(servers, selector)
    finally:
        for pid in servers:
            _signal_group(pid, signal.SIGKILL)
        os.unlink(path)


def _recv_or_reset(conn: socket.socket) -> bytes:
    try:
        return conn.recv(1)
    except OSError:
        return b""


def _reap(servers: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    """Tell each door whose server has exited how it ended."""
    while servers:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = servers.pop(pid, None)
        if conn is None:
            continue
        try:
            conn.sendall(f"exit {status}\n".encode())
        except OSError:  # its door is gone
            pass
        try:
            selector.unregister(conn)
        except KeyError:  # already, when its door went first
            pass
        conn.close()


def _answer(conn: socket.socket, environ: dict[str, str], imported: dict[str, str | None], selector, listener,
            servers) -> int | None:
    """Fork the requested server and tell the door its pid; None when declined (the door starts a fresh one)."""
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    try:
        size = struct.unpack(">I", data[:4])[0]
        while len(data) < 4 + size:
            more = conn.recv(4 + size - len(data))
            if not more:
                return None
            data += more
        request = json.loads(data[4:4 + size])
        differs = sorted(name for name in set(request["env"]) | set(environ)
                         if name not in RUN_TIME_VARIABLES and not name.startswith(RUN_TIME_PREFIXES)
                         and request["env"].get(name) != environ.get(name))
        if differs or len(fds) != 3:
            reason = f"{', '.join(differs)} differs from the zygote's" if differs else "no stdin/stdout/stderr came"
            print(f"vllm_zygote: declined {request['argv'][:1]}: {reason}", flush=True)
            conn.sendall(f"fresh {reason}\n".encode())
            return None
        pid = os.fork()
        if pid == 0:
            _become_server(request, imported, fds, [listener, *servers.values(), conn], selector)
        try:
            os.setpgid(pid, pid)  # as the child does: a signal the door relays at once finds the group
        except OSError:  # the child did it first, or is already gone
            pass
        conn.sendall(f"pid {pid}\n".encode())
        print(f"vllm_zygote: forked server {pid}: {' '.join(request['argv'])[:200]}", flush=True)
        return pid
    finally:
        for fd in fds:
            os.close(fd)


def _become_server(request: dict, imported: dict[str, str | None], fds: list[int], sockets: list[socket.socket],
                   selector) -> None:
    """In the forked child: take the door's stdio, environment and directory, then run the module as __main__."""
    code = 1
    try:
        import ctypes
        import runpy
        import warnings

        import setproctitle  # a vLLM dependency

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the zygote's end is the server's
        os.setpgid(0, 0)  # the server and its engine: the group the door's signals go to
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as in a fresh interpreter (the zygote's is its own)
        selector.close()
        for sock in sockets:
            sock.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        module, *args = request["argv"]
        # the server's command line in ps and /proc (before the environment is replaced: setproctitle finds the
        # room for a longer title in the original environment's memory)
        setproctitle.setproctitle(" ".join([sys.executable, "-m", module, *args, "(forked by vllm_zygote)"]))
        zygote_paths = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        for name, value in imported.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        sys.path[1:1] = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in
                         zygote_paths]  # where python puts $PYTHONPATH: after the script's directory
        # runpy warns that the module is already imported: it is, in the zygote, on purpose
        warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package",
                                category=RuntimeWarning)
        sys.argv = [module, *args]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        import atexit

        atexit._run_exitfuncs()  # as the interpreter would at exit; then never back into the zygote's loop
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "serve":
        serve(sys.argv[2])
    elif len(sys.argv) >= 3 and sys.argv[1] == "run":
        run(sys.argv[2:])
    else:
        sys.exit(__doc__)
