"""Verify TP modules the way tplayers verifies itself.

`World` is a persistent set of spawned ranks (gloo on loopback by default) that runs a
module-level function on every rank and returns the per-rank results. It is started once and
reused across tests and hypothesis examples. A failure, timeout or crash on any rank fails the
call with that rank's traceback, and the world is torn down and rebuilt on the next call:
nothing ever waits on a rank that is gone.

    with World(2) as world:
        reports = world.run(check, seed=0)   # check(group, seed) on every rank, results in rank order
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections import deque
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["World", "FORKSERVER_PRELOAD", "WorldError", "RankFailed", "WorldTimeout", "get_world", "shutdown_worlds"]


# ---------------------------------------------------------------------------- the rank world


class WorldError(RuntimeError):
    """A call on the world failed; the world has been torn down and will be rebuilt."""


class RankFailed(WorldError):
    """A rank raised. ``rank`` and ``remote_traceback`` say where and why."""

    def __init__(self, rank: int, remote_traceback: str, others: Dict[int, str]) -> None:
        self.rank, self.remote_traceback, self.others = rank, remote_traceback, others
        extra = f" (ranks {sorted(others)} failed too)" if others else ""
        super().__init__(f"rank {rank} failed{extra}:\n{remote_traceback}")


class WorldTimeout(WorldError):
    """Some ranks did not answer in time (hung collective, dead peer)."""


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists. (Not ``os.getppid() == pid``: a rank forked from the
    forkserver has the server, not the process that owns the world, as its parent.)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """SIGINT / SIGTERM held back for the body (delivered right after), where the main thread can."""
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    previous = mask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        mask(signal.SIG_SETMASK, previous)


def _exit_with_parent(parent_pid: int) -> None:
    """A rank's watchdog thread: when the process that owns the world is gone (SIGTERM, SIGKILL, a
    crash), exit at once, even mid-computation, instead of running its work to the end."""
    while _alive(parent_pid):
        time.sleep(0.5)
    os._exit(1)


def _worker_main(rank: int, size: int, backend: str, init_file: str, conn: Any,
                 collective_timeout_s: float, threads: int, parent_pid: int, stderr: Any) -> None:
    os.dup2(stderr.fileno(), 2)  # this rank's standard error goes through the world's owner (_StderrTail)
    stderr.close()
    torch.set_num_threads(threads)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True, name="tplayers-orphan-watch").start()
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=size,
                                timeout=timedelta(seconds=collective_timeout_s))
        conn.send_bytes(pickle.dumps(("ready", None)))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        return
    group = dist.group.WORLD
    while True:  # (orphaned, the watchdog thread above ends the process)
        if not conn.poll(1.0):
            continue
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if not data:
            break
        try:
            fn, args, kwargs = pickle.loads(data)
            payload: Tuple[str, Any] = ("ok", fn(group, *args, **kwargs))
        except BaseException:
            payload = ("error", traceback.format_exc())
        try:
            out = pickle.dumps(payload)
        except Exception:
            out = pickle.dumps(("error", f"the result could not be pickled:\n{traceback.format_exc()}"))
        conn.send_bytes(out)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


#: Modules the rank-forking server imports once, so a (re)started rank has them for free.
#: Extend it before the first world starts with whatever your rank functions import (a test
#: suite adds its test modules' heavy imports, e.g. "hypothesis", "pytest").
FORKSERVER_PRELOAD: List[str] = [
    "torch", "torch.distributed", "tplayers",
    "torch.distributed.tensor",  # torch.testing.assert_close imports it lazily: 2-3 s per fresh rank
]


class _StderrTail:
    """A rank's standard error, read by the process that owns the world: forwarded to its own standard error as it
    comes, the last lines kept, so that a rank that dies (a C++ abort, a fatal signal) is reported with what it
    wrote last. (The rank's end closes when it exits, whatever the cause: nothing it wrote is lost.)"""

    def __init__(self, sock: socket.socket, rank: int) -> None:
        self.sock, self.lines, self.partial = sock, deque(maxlen=_TAIL_LINES), b""
        self.thread = threading.Thread(target=self._pump, daemon=True, name=f"tplayers-rank{rank}-stderr")
        self.thread.start()

    def _pump(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                break
            if not data:
                break
            try:
                os.write(2, data)
            except OSError:
                pass
            *done, self.partial = (self.partial + data).split(b"\n")
            self.lines.extend(done)

    def tail(self, wait: float) -> str:
        """The last lines the rank wrote (waiting up to ``wait`` seconds for the rest of them to arrive)."""
        self.thread.join(timeout=wait)
        lines = list(self.lines) + ([self.partial] if self.partial else [])
        return "\n".join(line.decode("utf-8", errors="replace").rstrip() for line in lines if line.strip())

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


_TAIL_LINES = 12


def _how_it_ended(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def _context() -> Any:
    """Fork ranks from a server that has already imported torch (a rank starts in well under a
    second, so rebuilding a world after a failure is cheap); spawn where forkserver is missing."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        return ctx
    return mp.get_context("spawn")


class World:
    """N spawned ranks in one process group, reused across calls.

    ``run(fn, *args, **kwargs)`` calls ``fn(group, *args, **kwargs)`` on every rank, where
    ``group`` is the world's ProcessGroup, and returns the results in rank order. ``fn`` must
    be importable (a module-level function) and its arguments and results picklable.
    """

    def __init__(self, size: int, *, backend: str = "gloo", timeout: float = 120.0,
                 collective_timeout: float = 60.0, start_timeout: float = 180.0, threads: int = 1) -> None:
        if size < 1:
            raise ValueError(f"World size must be >= 1, got {size}")
        self.size, self.backend, self.timeout = size, backend, timeout
        self.collective_timeout, self.start_timeout, self.threads = collective_timeout, start_timeout, threads
        self._procs: List[Any] = []
        self._conns: List[Any] = []
        self._stderr: List[_StderrTail] = []
        self._tmpdir: Optional[tempfile.TemporaryDirectory] = None
        self.starts = 0  # how many times the ranks were (re)started

    # -- lifecycle
    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> "World":
        if self.alive:
            return self
        self.close()
        ctx = _context()
        self._tmpdir = tempfile.TemporaryDirectory(prefix="tplayers-world-")
        init_file = os.path.join(self._tmpdir.name, "rendezvous")
        try:
            for rank in range(self.size):
                parent, child = ctx.Pipe()
                err_mine, err_rank = socket.socketpair()
                p = ctx.Process(target=_worker_main, daemon=True, name=f"tplayers-rank{rank}",
                                args=(rank, self.size, self.backend, init_file, child,
                                      self.collective_timeout, self.threads, os.getpid(), err_rank))
                with _interrupts_deferred():  # a started rank is always one close() knows of
                    p.start()
                    self._procs.append(p)
                    self._conns.append(parent)
                    self._stderr.append(_StderrTail(err_mine, rank))
                child.close()
                err_rank.close()
            self.starts += 1
            self._collect(self.start_timeout, what="start")
        except BaseException:  # Ctrl-C / SIGTERM mid-start: no rank may wait out its rendezvous alone
            self.close(force=True)
            raise
        return self

    def close(self, *, force: bool = False) -> None:
        """Stop every rank: politely (they leave the process group), or at once with ``force``."""
        if not force:
            for c in self._conns:
                try:
                    c.send_bytes(b"")
                except Exception:
                    pass
        deadline = time.monotonic() + (0 if force else 5)
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for c in self._conns:
            c.close()
        for tail in self._stderr:
            tail.close()
        self._procs, self._conns, self._stderr = [], [], []
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> "World":
        return self.start()

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        # interrupted (Ctrl-C, SIGTERM as the CLI maps it): the ranks' work is moot, stop them at once
        self.close(force=exc_type is not None and not issubclass(exc_type, Exception))

    # -- calls
    def run(self, fn: Callable[..., Any], *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> List[Any]:
        """``fn(group, *args, **kwargs)`` on every rank; the results, in rank order."""
        try:
            data = pickle.dumps((fn, args, kwargs))
        except Exception as e:
            raise TypeError(
                f"World.run needs a module-level function and picklable arguments: {e}"
            ) from e
        self.start()
        for c in self._conns:
            c.send_bytes(data)
        return self._collect(self.timeout if timeout is None else timeout, what=getattr(fn, "__qualname__", "call"))

    def _death(self, r: int, what: str) -> str:
        """What a rank that stopped answering came to: how it ended and the last lines it wrote to stderr."""
        proc = self._procs[r]
        proc.join(timeout=2)
        tail = self._stderr[r].tail(wait=1.0) if r < len(self._stderr) else ""
        said = ("; its last lines on stderr:\n    " + tail.replace("\n", "\n    ") if tail
                else "; it wrote nothing to stderr")
        if proc.exitcode is None:  # (its pipe closed, the process not gone yet)
            return f"rank {r} closed its pipe during {what} and has not exited{said}"
        return f"rank {r} died ({_how_it_ended(proc.exitcode)}) during {what}{said}"

    def _collect(self, timeout: float, what: str) -> List[Any]:
        results: List[Any] = [None] * self.size
        errors: Dict[int, str] = {}
        pending = set(range(self.size))
        deadline = time.monotonic() + timeout
        grace_deadline: Optional[float] = None  # after the first failure, peers get a moment to report
        while pending:
            now = time.monotonic()
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            if now >= limit:
                break
            ready = mpc.wait([self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending],
                             timeout=min(1.0, limit - now))
            for r in list(pending):
                conn, proc = self._conns[r], self._procs[r]
                if conn in ready or conn.poll():
                    try:
                        status, value = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):  # its end closed: the rank is gone, or going
                        status, value = "error", self._death(r, what)
                elif proc.sentinel in ready or not proc.is_alive():
                    status, value = "error", self._death(r, what)
                else:
                    continue
                pending.discard(r)
                if status == "ok" or status == "ready":
                    results[r] = value
                else:
                    errors[r] = value
                    if grace_deadline is None:
                        grace_deadline = time.monotonic() + 2.0
        if errors or pending:
            self.close(force=True)  # a half-finished collective poisons the group: rebuild on the next call
            if errors:
                first = next(iter(errors))  # the earliest report: later ones are usually its echoes
                raise RankFailed(first, errors[first], {r: t for r, t in errors.items() if r != first})
            raise WorldTimeout(f"ranks {sorted(pending)} of {self.size} did not finish {what} within {timeout:.0f}s")
        return results


_WORLDS: Dict[Tuple[int, str], World] = {}


def get_world(size: int, backend: str = "gloo", **options: Any) -> World:
    """The process-wide persistent world of ``size`` ranks (started on first use)."""
    key = (size, backend)
    if key not in _WORLDS:
        _WORLDS[key] = World(size, backend=backend, **options)
    return _WORLDS[key]


@atexit.register
def shutdown_worlds() -> None:
    """Stop every world `get_world` started."""
    for w in _WORLDS.values():
        w.close()
    _WORLDS.clear()
