"""Process sandbox for model-written Python code (Thyme's image-editing code).

The boundary is the operating system, not Python.  Every job runs in its own one-shot
worker process (``_sandbox_worker.py``, started with ``python -I -S -B``) which, before it
even reads the job:

* leads a new session / process group (the host kills the whole group), gets
  ``PR_SET_PDEATHSIG`` (dies with the host; seccomp refuses to change it afterwards) and
  ``no_new_privs``;
* lives in a new **network namespace** (just an unconfigured loopback: every
  ``connect()`` fails, ``127.0.0.1`` included), plus new mount and IPC namespaces when root;
* has pre-imported the allowed modules (PIL with all its plugins, numpy, ...), then (root)
  mounted a size-limited private **tmpfs** (``disk_mb``, 4096 inodes, nosuid/nodev/noexec)
  on its work dir and ``chroot``-ed into it: the host filesystem (``/etc/passwd``, the
  project's sources, the original image) does not exist for the code, and the work dir is
  the only writable place;
* (root) runs as a **dedicated unprivileged uid/gid** (a random unused high uid per worker,
  ``setgroups([])``, no capabilities): it cannot chroot back out, regain root,
  signal/ptrace other processes, or chmod/overwrite/delete the input copy (owned by root,
  mode 0444, in a sticky root-owned directory);
* has rlimits: ``RLIMIT_AS`` (memory), ``RLIMIT_CPU`` (+ a precise ``ITIMER_PROF``),
  ``RLIMIT_FSIZE`` (file size), ``RLIMIT_NPROC = 0`` (no fork, no threads, no
  subprocess), ``RLIMIT_NOFILE`` small, ``RLIMIT_CORE = 0``, bounded ``RLIMIT_STACK``;
* has a fresh, empty session keyring (joined before the uid drop) and a **seccomp** filter
  (EPERM) on the kernel keyring, SysV shared memory / message queues / semaphores and memfd
  (memory that ``RLIMIT_AS`` does not count), and on ptrace, mount, unshare, setns, chroot,
  bpf, io_uring, userfaultfd, perf_event_open, module loading, exec and
  ``prctl(PR_SET_PDEATHSIG)``;
* has its own wall-clock limit: a POSIX timer that sends SIGKILL ``wall_seconds`` +
  ``WORKER_WALL_GRACE_SECONDS`` after the job starts, armed before the code runs (a second
  seccomp filter then refuses ``timer_settime``/``timer_delete``), so a worker cannot outlive
  a killed or stuck host by more than that even if the parent-death signal did not fire.

The host enforces the wall-clock limit (``os.killpg(SIGKILL)``), reads a bounded amount of
output (the worker keeps ``max_output_bytes`` of stdout+stderr and stops the code once it
printed 10x that), treats the worker's answer as untrusted (size-capped, nesting-capped, type-checked, lone
surrogates and invalid UTF-8 replaced; anything else is a protocol error, never an exception),
copies saved images out with ``O_NOFOLLOW``/``O_NONBLOCK`` + ``fstat`` (planted symlinks and
FIFOs are ignored; only real, non-sparse image files owned by the sandbox uid are taken, at
most ``MAX_IMAGES`` and ``disk_mb`` in all per run, chosen by ``lstat`` and opened one at a
time; ``SandboxResult.discard`` deletes the copies once read), and
replaces every worker after one job.

The worker also runs the code with a restricted ``__builtins__`` (an import whitelist and
an ``open`` limited to the work dir; ``socket``, ``subprocess``, ... poisoned in
``sys.modules``).  That layer is **defence in depth only**: it is easily bypassed through
the object graph (``().__class__.__base__.__subclasses__()``, ``PIL.Image.os``, the
allowed ``io.open``) and none of the guarantees above depends on it.

Degraded modes (each result reports the active layers in :attr:`SandboxResult.isolation`):

* not root: no chroot, no uid change, no tmpfs.  Still a separate process with all the
  rlimits (``NPROC = 0`` holds for a non-root uid), a network namespace obtained through an
  unprivileged user namespace when the kernel allows it (capabilities dropped afterwards),
  and the Python layer.  Files the host user can read/write, the code can too.
* no network namespace (no ``CAP_SYS_ADMIN``, user namespaces disabled): ``socket`` /
  ``_socket`` / ``ssl`` are poisoned in ``sys.modules`` (no import path, not even the real
  ``__import__``, yields them; under chroot the extension modules cannot be loaded from
  disk either) and ctypes' library loaders (``CDLL``, ``cdll``, ``pythonapi``,
  ``_ctypes.dlopen``) are removed.  This is **best effort**: without a namespace or a
  seccomp filter, code that finds another route to native code can reach the network.

``strict=True`` refuses to start workers unless netns + chroot + uid drop all succeeded.

Thyme integration: the code refers to the image by a path string.  Put
``Sandbox.image_name_in_sandbox(host_path)`` (a bare file name such as ``"photo.jpg"``,
relative to the code's working directory, which is also ``/`` of the chroot) in the
prompt, and/or rely on the global variable ``image_path`` (name configurable with
``run(..., var_name=...)``) that ``run`` defines for the code.  Images the code saves in its
working directory (``img.save("crop.png")``) come back as host paths in
:attr:`SandboxResult.images`; other directories do not exist in the sandbox.
"""

from __future__ import annotations

import json
import os
import queue
import random
import selectors
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "DEFAULT_ALLOWED_MODULES",
    "Sandbox",
    "SandboxResult",
    "SandboxStartupError",
]

WORKER_FILE = str(Path(__file__).with_name("_sandbox_worker.py"))

DEFAULT_ALLOWED_MODULES: tuple[str, ...] = (
    "PIL",
    "numpy",
    "cv2",
    "math",
    "cmath",
    "statistics",
    "random",
    "re",
    "json",
    "io",
    "collections",
    "itertools",
    "functools",
    "operator",
    "base64",
    "string",
    "copy",
    "heapq",
    "bisect",
    "fractions",
    "decimal",
    "time",
    "datetime",
    "textwrap",
    "typing",
    "dataclasses",
    "enum",
    "colorsys",
    "struct",
    "array",
)  # cv2 only when installed

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
MAX_IMAGES = 32
OUTPUT_STOP_FACTOR = 10
MAX_CODE_BYTES = 4 * 1024 * 1024
# The worker's own wall-clock limit is the host's plus this: the host normally stops a job
# first (and copies its images out meanwhile); the worker's timer only ends one whose host
# is gone or stuck.
WORKER_WALL_GRACE_SECONDS = 5.0
_SAFE_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-+")


def _has_image_magic(head: bytes) -> bool:
    return (
        head.startswith((b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"BM"))
        or head.startswith((b"II*\x00", b"MM\x00*"))
        or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")
    )


class SandboxStartupError(RuntimeError):
    """A worker process could not be started (infrastructure problem, not the code's)."""


@dataclass
class SandboxResult:
    """Outcome of one :meth:`Sandbox.run`.

    ``error`` is a one-paragraph message meant to be shown to the model: the last lines of
    the Python traceback, or ``"Sandbox error: ..."`` for limits (time, memory, output) and
    crashes.  ``images`` are host paths of copies of the image files the code saved in its
    working directory (they live in the sandbox's output dir; removed by ``close()`` unless
    ``output_dir`` was given).  ``isolation`` reports which OS-level layers were active.
    """

    ok: bool
    stdout: str
    error: str | None
    images: list[str] = field(default_factory=list)
    elapsed: float = 0.0
    isolation: dict = field(default_factory=dict)

    def discard(self) -> None:
        """Delete the copies in ``images`` (once read): a long run keeps no disk per job."""
        for path in self.images:
            try:
                os.unlink(path)
            except OSError:
                pass
        for folder in {os.path.dirname(p) for p in self.images}:
            try:
                os.rmdir(folder)
            except OSError:
                pass
        self.images = []


class _ProtocolError(Exception):
    pass


MAX_FRAME_DEPTH = 8  # the worker's frames are flat objects; anything deeper is forged


def _clean(value: object, depth: int = 0) -> object:
    """``value`` with lone surrogates (valid JSON escapes, not text) replaced by U+FFFD;
    ``_ProtocolError`` past ``MAX_FRAME_DEPTH`` levels."""
    if depth > MAX_FRAME_DEPTH:
        raise _ProtocolError("malformed frame: nested too deeply")
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    if isinstance(value, list):
        return [_clean(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {_clean(k, depth + 1): _clean(v, depth + 1) for k, v in value.items()}
    return value


def _parse_frame(data: bytes) -> dict:
    """One frame from the worker, untrusted (the code may forge one): a dict, or else a
    ``_ProtocolError``. The caller bounds the size; the parser's own recursion guard and
    ``_clean`` bound the nesting; invalid UTF-8 and lone surrogates become U+FFFD."""
    try:
        frame = json.loads(data.decode("utf-8", "replace"))
    except (ValueError, RecursionError) as exc:
        raise _ProtocolError(f"malformed frame: {type(exc).__name__}") from None
    if not isinstance(frame, dict):
        raise _ProtocolError("malformed frame")
    return _clean(frame)  # type: ignore[return-value]


def _pick_uid_range() -> tuple[int, int] | None:
    """A range of uids that exist in our user namespace and belong to no real account."""
    try:
        with open("/proc/self/uid_map") as f:
            rows = [tuple(int(x) for x in line.split()) for line in f if line.strip()]
    except OSError:
        return None
    best = None
    for inside, _outside, count in rows:
        lo, hi = max(inside, 100_000), min(inside + count, 0xFFFF_FFFE)
        if hi - lo >= 1000 and (best is None or hi - lo > best[1] - best[0]):
            best = (lo, hi)
    if best and best[1] - best[0] > 1_000_000_000:  # full map: stay well away from users
        best = (1_000_000_000, best[1])
    return best


def _library_path() -> list[str]:
    """The host's ``sys.path`` minus script/project directories: only the interpreter's
    own library dirs and site-packages, so no project file can shadow an allowed module."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    keep = []
    for entry in sys.path:
        if not entry or not os.path.exists(entry):
            continue
        real = os.path.realpath(entry)
        in_prefix = any(real == p or real.startswith(p + os.sep) for p in prefixes)
        if in_prefix or "site-packages" in real or "dist-packages" in real:
            keep.append(entry)
    return keep


def _uid_in_use(uid: int) -> bool:
    import grp
    import pwd

    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except KeyError:
            pass
    return False


class _Worker:
    """Host-side handle of one worker process."""

    def __init__(
        self,
        proc: subprocess.Popen,
        base: str,
        workdir: str,
        uid: int,
        gid: int,
        wall_limit: float,
    ):
        self.proc = proc
        self.base = base
        self.workdir = workdir
        self.uid = uid
        self.gid = gid
        self.wall_limit = wall_limit  # seconds after which the worker's own timer kills it
        self.isolation: dict = {}
        self.buf = bytearray()
        self.err = bytearray()
        self.out_fd = proc.stdout.fileno()
        self.err_fd = proc.stderr.fileno()
        os.set_blocking(self.out_fd, False)
        os.set_blocking(self.err_fd, False)
        self.out_eof = False
        self.err_eof = False
        self.rusage = None
        self.reaped = False
        self.cleaned = False
        self._reap_lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_tail(self, limit: int = 600) -> str:
        text = self.err.decode("utf-8", "replace").strip()
        return text[-limit:]

    def read_frame(self, deadline: float, max_len: int) -> dict | None:
        """Next frame, ``None`` on timeout; ``EOFError`` if the worker closed stdout."""
        with selectors.DefaultSelector() as sel:
            if not self.out_eof:
                sel.register(self.out_fd, selectors.EVENT_READ)
            if not self.err_eof:
                sel.register(self.err_fd, selectors.EVENT_READ)
            while True:
                if len(self.buf) >= 4:
                    (n,) = struct.unpack(">I", self.buf[:4])
                    if n > max_len:
                        raise _ProtocolError(f"oversized frame ({n} bytes)")
                    if len(self.buf) >= 4 + n:
                        data = bytes(self.buf[4 : 4 + n])
                        del self.buf[: 4 + n]
                        return _parse_frame(data)
                if self.out_eof:
                    raise EOFError
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    return None
                for key, _ in sel.select(timeout):
                    try:
                        data = os.read(key.fd, 1 << 16)
                    except BlockingIOError:
                        continue
                    if key.fd == self.out_fd:
                        if data:
                            self.buf += data
                        else:
                            self.out_eof = True
                            sel.unregister(key.fd)
                    else:
                        if data:
                            self.err += data
                            if len(self.err) > 16384:  # keep a bounded tail only
                                del self.err[:-8192]
                        else:
                            self.err_eof = True
                            sel.unregister(key.fd)

    def signal_group(self, sig: int) -> None:
        if self.reaped:
            return
        try:
            os.killpg(self.proc.pid, sig)  # leader unreaped => the pgid cannot be reused
        except (ProcessLookupError, PermissionError):
            pass

    def alive(self) -> bool:
        """Non-blocking liveness check; reaps (never signals) a dead worker."""
        with self._reap_lock:
            if self.reaped:
                return False
            try:
                pid, status, rusage = os.wait4(self.proc.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status, rusage = self.proc.pid, 0, None
            if pid == 0:
                return True
            self.rusage = rusage
            self.proc.returncode = os.waitstatus_to_exitcode(status)
            self.reaped = True
            return False

    def kill_and_reap(self) -> None:
        with self._reap_lock:
            if not self.reaped:
                self.signal_group(signal.SIGKILL)
                try:
                    _, status, self.rusage = os.wait4(self.proc.pid, 0)
                    self.proc.returncode = os.waitstatus_to_exitcode(status)
                except ChildProcessError:
                    self.proc.returncode = self.proc.returncode or -signal.SIGKILL
                self.reaped = True
            if self.cleaned:
                return
            self.cleaned = True
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                stream.close()
            except OSError:
                pass
        shutil.rmtree(self.base, ignore_errors=True)


def _kill_all(workers: set, lock: threading.Lock | None = None) -> None:
    if lock is not None:
        with lock:
            victims = list(workers)
            workers.clear()
    else:  # interpreter exit (weakref.finalize): no other thread runs any more
        victims = list(workers)
        workers.clear()
    for w in victims:
        try:
            w.kill_and_reap()
        except Exception:
            pass


class Sandbox:
    """Runs untrusted Python snippets in isolated one-shot worker processes.

    Thread-safe: concurrent :meth:`run` calls each use their own worker.  A warm pool of
    ``pool_size`` ready workers (interpreter started, modules imported, isolation applied)
    is refilled in the background; ``pool_size=0`` spawns a worker per call.

    Limits: ``cpu_seconds`` (RLIMIT_CPU), ``wall_seconds`` (host kill), ``memory_mb``
    (RLIMIT_AS = the preloaded interpreter's address space + ``memory_mb``),
    ``max_output_bytes`` (stdout+stderr kept; the code is stopped past 10x),
    ``max_file_bytes`` (RLIMIT_FSIZE, also the largest image copied back), ``disk_mb``
    (size of the private tmpfs work dir when root).
    """

    def __init__(
        self,
        *,
        cpu_seconds: float = 10,
        memory_mb: int = 1024,
        wall_seconds: float = 15,
        max_output_bytes: int = 64 * 1024,
        max_file_bytes: int = 32 * 1024 * 1024,
        pool_size: int = 2,
        allowed_modules: tuple[str, ...] | list[str] = DEFAULT_ALLOWED_MODULES,
        disk_mb: int = 256,
        max_open_files: int = 64,
        stack_mb: int = 16,
        uid: int | None = None,
        output_dir: str | None = None,
        startup_timeout: float = 60.0,
        strict: bool = False,
        python: str | None = None,
    ):
        if sys.platform != "linux":
            raise RuntimeError("the sandbox needs Linux (namespaces, chroot, rlimits)")
        self.cpu_seconds = cpu_seconds
        self.memory_mb = int(memory_mb)
        self.wall_seconds = wall_seconds
        self.max_output_bytes = int(max_output_bytes)
        self.max_file_bytes = int(max_file_bytes)
        self.pool_size = max(0, int(pool_size))
        self.allowed_modules = tuple(allowed_modules)
        self.disk_mb = int(disk_mb)
        # Copied back per run, all images together: no more than the work dir itself can hold.
        self.max_copy_bytes = self.disk_mb * 1024 * 1024
        self.startup_timeout = startup_timeout
        self._python = python or sys.executable
        self._is_root = os.geteuid() == 0
        self._fixed_uid = uid
        self._uid_range = _pick_uid_range() if self._is_root and uid is None else None
        self._cfg = {
            "sys_path": _library_path(),
            "allowed": list(self.allowed_modules),
            "tmpfs_mb": self.disk_mb,
            "nproc": 0,
            "nofile": int(max_open_files),
            "max_file_bytes": self.max_file_bytes,
            "stack_bytes": int(stack_mb) * 1024 * 1024,
            "memory_mb": self.memory_mb,
            "cpu_seconds": cpu_seconds,
            "worker_wall_seconds": wall_seconds + WORKER_WALL_GRACE_SECONDS,
            "max_output_bytes": self.max_output_bytes,
            "stop_output_bytes": self.max_output_bytes * OUTPUT_STOP_FACTOR,
            "host_pid": os.getpid(),
            "strict": bool(strict),
        }
        self._env = {
            "PATH": "/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "HOME": "/",
            "TMPDIR": "/",
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "NUMEXPR_NUM_THREADS": "1",
        }
        if os.environ.get("LD_LIBRARY_PATH"):
            self._env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
        self._owns_output_dir = output_dir is None
        self._output_dir = output_dir or tempfile.mkdtemp(prefix="speceyes-sandbox-out-")
        os.makedirs(self._output_dir, exist_ok=True)
        self._run_counter = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._ready: deque[_Worker] = deque()
        self._workers: set[_Worker] = set()  # every live worker, for cleanup
        self._uids_in_use: set[int] = set()
        self._spawn_failures = 0
        self._last_spawn_error: str | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)
        self._thread: threading.Thread | None = None
        self._reap_queue: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        self._reaper = threading.Thread(target=self._reap_loop, name="sandbox-reaper", daemon=True)
        self._reaper.start()
        if self.pool_size:
            self._thread = threading.Thread(
                target=self._refill_loop, name="sandbox-pool", daemon=True
            )
            self._thread.start()

    # ------------------------------------------------------------------ public API

    @staticmethod
    def image_name_in_sandbox(image_path: str) -> str:
        """File name under which ``run(code, image_path)`` exposes the image to the code.

        It is the (sanitised) base name of ``image_path``, relative to the code's working
        directory, e.g. ``"/data/img 01.jpg"`` -> ``"img_01.jpg"``.
        """
        base = os.path.basename(os.fspath(image_path))
        stem, ext = os.path.splitext(base)
        stem = "".join(c if c in _SAFE_NAME_CHARS else "_" for c in stem).strip("._")[:100]
        ext = "".join(c for c in ext if c in _SAFE_NAME_CHARS)[:10]
        return (stem or "input") + (ext.lower() if ext else ".png")

    def run(
        self, code: str, image_path: str | None = None, *, var_name: str = "image_path"
    ) -> SandboxResult:
        """Execute ``code`` in a fresh isolated process and return its result.

        If ``image_path`` is given, a read-only copy of it is placed in the code's working
        directory under :meth:`image_name_in_sandbox` and that name is bound to the global
        variable ``var_name`` (pass ``var_name=""`` to not define it).
        """
        t0 = time.monotonic()
        if self._closed:
            raise RuntimeError("Sandbox is closed")
        if not isinstance(code, str):
            raise TypeError("code must be a str")
        if len(code.encode("utf-8", "surrogatepass")) > MAX_CODE_BYTES:
            return SandboxResult(False, "", "Sandbox error: the code is too long.", [], 0.0)
        image_name = None
        if image_path is not None:
            size = os.stat(image_path).st_size  # FileNotFoundError: caller's bug
            if size > self.disk_mb * 1024 * 1024 // 2:
                raise ValueError(f"input image too large for the sandbox ({size} bytes)")
            image_name = self.image_name_in_sandbox(image_path)
        if var_name and not var_name.isidentifier():
            raise ValueError(f"invalid var_name {var_name!r}")

        worker = self._acquire()
        try:
            return self._execute(worker, code, image_path, image_name, var_name, t0)
        finally:
            if not worker.reaped:
                worker.signal_group(signal.SIGKILL)
                self._reap_later(worker)  # process teardown takes ~10 ms: off the hot path
            with self._cond:
                self._cond.notify_all()  # refill the pool now that this job is done

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Block until the warm pool is full (``True``) or ``timeout`` expires."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._ready) < self.pool_size and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return not self._closed

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        _kill_all(self._workers, self._lock)
        if self._thread is not None:
            self._thread.join(timeout=10)
            _kill_all(self._workers, self._lock)  # anything the thread finished starting meanwhile
        self._reap_queue.put(None)
        self._reaper.join(timeout=10)
        self._ready.clear()
        if self._owns_output_dir:
            shutil.rmtree(self._output_dir, ignore_errors=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ pool

    def _refill_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and len(self._ready) >= self.pool_size:
                    self._cond.wait()
                if self._closed:
                    return
            try:
                worker = self._spawn_ready()
            except Exception as exc:  # keep serving; run() reports the error itself
                with self._cond:
                    self._spawn_failures += 1
                    self._last_spawn_error = str(exc)
                    self._cond.notify_all()
                    failures = self._spawn_failures
                time.sleep(min(5.0, 0.2 * 2**failures))
                continue
            with self._cond:
                self._spawn_failures = 0
                if not self._closed:
                    self._ready.append(worker)
                    self._cond.notify_all()
                    continue
            self._reap_now(worker)
            return

    def _acquire(self) -> _Worker:
        if self.pool_size:
            deadline = time.monotonic() + self.startup_timeout
            with self._cond:
                while True:
                    while self._ready:
                        worker = self._ready.popleft()
                        if worker.alive():
                            return worker
                        self._reap_later(worker)  # died while idle: discard
                    remaining = deadline - time.monotonic()
                    if self._closed or self._spawn_failures >= 2 or remaining <= 0:
                        break
                    self._cond.notify_all()  # pool empty: make sure the refill runs
                    self._cond.wait(remaining)
        return self._spawn_ready()  # cold start (or a clear error if spawning fails)

    def _reap_now(self, w: _Worker) -> None:
        w.kill_and_reap()
        with self._lock:
            self._workers.discard(w)
            self._uids_in_use.discard(w.uid)

    def _reap_later(self, w: _Worker) -> None:
        """Queue ``w`` for the reaper thread (callable with ``self._lock`` held)."""
        self._reap_queue.put(w)

    def _reap_loop(self) -> None:
        while True:
            w = self._reap_queue.get()
            if w is None:
                return
            try:
                self._reap_now(w)
            except Exception:
                pass

    def _new_uid(self) -> int:
        if self._fixed_uid is not None:
            return self._fixed_uid
        if self._uid_range is None:
            return 65534  # nobody (small uid map): workers share the uid
        lo, hi = self._uid_range
        for _ in range(100):
            uid = random.randrange(lo, hi)
            if uid not in self._uids_in_use and not _uid_in_use(uid):
                return uid
        return 65534

    def _spawn_ready(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("Sandbox is closed")
            uid = self._new_uid() if self._is_root else os.getuid()
            self._uids_in_use.add(uid)
        gid = uid if self._is_root else os.getgid()
        base = tempfile.mkdtemp(prefix="speceyes-sandbox-")
        workdir = os.path.join(base, "root")
        os.mkdir(workdir, 0o700)
        if self._is_root:
            # Root-owned, group-writable for the sandbox gid, sticky: the code may create
            # files but cannot delete/rename the root-owned input copy.
            os.chown(workdir, 0, gid)
            os.chmod(workdir, 0o1770)
        cfg = dict(self._cfg, workdir=workdir, uid=uid, gid=gid)
        try:
            proc = subprocess.Popen(
                [self._python, "-I", "-S", "-B", WORKER_FILE, json.dumps(cfg)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self._env,
                cwd=base,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            shutil.rmtree(base, ignore_errors=True)
            with self._lock:
                self._uids_in_use.discard(uid)
            raise SandboxStartupError(f"cannot start sandbox worker: {exc}") from exc
        worker = _Worker(proc, base, workdir, uid, gid, float(cfg["worker_wall_seconds"]))
        with self._lock:
            self._workers.add(worker)
        try:
            frame = worker.read_frame(time.monotonic() + self.startup_timeout, 1 << 20)
            if frame is None:
                raise SandboxStartupError(
                    f"sandbox worker did not start within {self.startup_timeout} s"
                )
            if frame.get("type") != "ready":
                raise SandboxStartupError(f"unexpected frame from sandbox worker: {frame}")
        except (EOFError, _ProtocolError, SandboxStartupError) as exc:
            self._reap_now(worker)
            detail = worker.stderr_tail(2000) or str(exc) or type(exc).__name__
            raise SandboxStartupError(f"sandbox worker failed to start: {detail}") from None
        worker.isolation = frame.get("isolation") or {}
        return worker

    # ------------------------------------------------------------------ one job

    def _root_view(self, w: _Worker) -> str:
        """Host path of the worker's work dir (its private tmpfs is only in its namespace)."""
        if w.isolation.get("tmpfs"):
            return f"/proc/{w.pid}/root"
        return w.workdir

    def _execute(
        self,
        w: _Worker,
        code: str,
        image_path: str | None,
        image_name: str | None,
        var_name: str,
        t0: float,
    ) -> SandboxResult:
        iso = dict(w.isolation)
        iso.pop("loaded", None)
        if image_path is not None:
            self._copy_in(w, image_path, image_name)
        job = {"code": code, "image_name": image_name, "var_name": var_name}
        data = json.dumps(job, ensure_ascii=False).encode("utf-8", "surrogatepass")
        frame: dict | None = None
        failure: str | None = None
        started = time.monotonic()
        try:
            w.proc.stdin.write(struct.pack(">I", len(data)) + data)
            w.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            failure = "eof"
        if failure is None:
            deadline = time.monotonic() + self.wall_seconds
            try:
                frame = w.read_frame(deadline, 6 * self.max_output_bytes + (1 << 20))
                if frame is None:
                    failure = "timeout"
                elif frame.get("type") != "result":
                    failure = "protocol"
            except EOFError:
                failure = "eof"
            except _ProtocolError:
                failure = "protocol"
        w.signal_group(signal.SIGSTOP)  # freeze the worker while we read its work dir
        images = self._copy_out(w, image_name)
        if failure is None and frame is not None:
            w.signal_group(signal.SIGKILL)  # reaped in the background by run()
            return self._result_from_frame(frame, images, time.monotonic() - t0, iso)
        self._reap_now(w)  # the exit status tells which limit was hit
        message = self._failure_message(w, failure, time.monotonic() - started)
        return SandboxResult(False, "", message, images, time.monotonic() - t0, iso)

    def _result_from_frame(
        self, frame: dict, images: list[str], elapsed: float, iso: dict
    ) -> SandboxResult:
        stdout = frame.get("stdout")
        stdout = stdout if isinstance(stdout, str) else ""
        raw = stdout.encode("utf-8", "surrogatepass")
        total = frame.get("stdout_total")
        total = total if isinstance(total, int) else len(raw)
        if len(raw) > self.max_output_bytes:
            raw = raw[: self.max_output_bytes]
            stdout = raw.decode("utf-8", "ignore")
        if total > len(raw):
            stdout += (
                f"\n[output truncated: showing the first {len(raw)} of "
                f"{'more than ' if total >= self.max_output_bytes * OUTPUT_STOP_FACTOR else ''}"
                f"{total} bytes]"
            )
        error = frame.get("error")
        error = error[:8000] if isinstance(error, str) else None
        ok = frame.get("ok") is True and error is None
        if not ok and error is None:
            error = "Sandbox error: the code failed."
        return SandboxResult(ok, stdout, error, images, elapsed, iso)

    def _failure_message(self, w: _Worker, failure: str | None, ran: float) -> str:
        rc = w.proc.returncode
        cpu = 0.0
        if w.rusage is not None:
            cpu = w.rusage.ru_utime + w.rusage.ru_stime
        wall_message = (
            f"Sandbox error: time limit of {self.wall_seconds:g} s exceeded (wall clock); "
            "the code was stopped. Make it faster or avoid waiting/infinite loops."
        )
        if failure == "timeout":
            return wall_message
        cpu_signals = (-signal.SIGPROF, -signal.SIGXCPU)
        if rc in cpu_signals or (rc == -signal.SIGKILL and cpu >= self.cpu_seconds - 0.5):
            return (
                f"Sandbox error: time limit of {self.cpu_seconds:g} s exceeded (CPU time); "
                "the code was stopped. Make it faster or avoid infinite loops."
            )
        if rc == -signal.SIGKILL and ran >= w.wall_limit:  # the worker's own wall timer
            return wall_message
        if failure == "protocol":
            return "Sandbox error: the code interfered with the sandbox protocol and was stopped."
        tail = w.stderr_tail(400)
        detail = f" Last messages: {tail}" if tail else ""
        if rc is not None and rc < 0:
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = f"signal {-rc}"
            return (
                f"Sandbox error: the process crashed ({name}), e.g. the memory limit of "
                f"{self.memory_mb} MB or the stack limit was hit inside native code, or the "
                f"recursion was too deep.{detail}"
            )
        return f"Sandbox error: the process exited unexpectedly (exit code {rc}).{detail}"

    def _copy_in(self, w: _Worker, image_path: str, name: str) -> None:
        # The worker is idle (blocked on stdin, no user code has run yet), so nothing in
        # its work dir can race us; O_EXCL|O_NOFOLLOW anyway.
        dest = os.path.join(self._root_view(w), name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with open(image_path, "rb") as src:
            fd = os.open(dest, flags, 0o444)
            with os.fdopen(fd, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
                os.fchmod(dst.fileno(), 0o444)
                if self._is_root:
                    os.fchown(dst.fileno(), 0, 0)

    def _copy_out(self, w: _Worker, skip_name: str | None) -> list[str]:
        """Copy the images the code saved, oldest first, at most ``MAX_IMAGES`` and
        ``max_copy_bytes`` in all. Candidates are chosen by ``lstat`` (the worker is stopped,
        so nothing changes meanwhile) and opened one at a time: a work dir full of planted
        files costs the host one file descriptor, not one per file."""
        root = self._root_view(w)
        try:
            entries = list(os.scandir(root))
        except OSError:
            return []  # the worker is gone (its private tmpfs went with it)
        candidates = []
        for entry in entries:
            name = entry.name
            if name == skip_name or not name.lower().endswith(IMAGE_EXTENSIONS):
                continue
            if len(name) > 200 or any(c in name for c in "\n\r\t\x00/"):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # vanished
            if self._copyable(st):
                candidates.append((st.st_mtime_ns, name, st.st_dev, st.st_ino))
        candidates.sort()
        paths: list[str] = []
        run_dir = None
        budget = self.max_copy_bytes
        for _, name, dev, ino in candidates:
            if len(paths) >= MAX_IMAGES:
                break
            try:
                fd = os.open(
                    os.path.join(root, name),
                    os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                )
            except OSError:
                continue  # symlink (ELOOP), vanished, ...
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) != (dev, ino) or not self._copyable(st):
                    continue  # not the file chosen above
                if st.st_size > budget or not _has_image_magic(os.pread(fd, 16, 0)):
                    continue  # over the copy budget, or junk with an image extension
                budget -= st.st_size
                if run_dir is None:
                    with self._lock:
                        self._run_counter += 1
                        n = self._run_counter
                    run_dir = os.path.join(self._output_dir, f"run{n:06d}-{w.pid}")
                    os.makedirs(run_dir, exist_ok=True)
                dest = os.path.join(run_dir, name)
                with open(dest, "wb") as out:
                    remaining = self.max_file_bytes
                    while remaining > 0:
                        chunk = os.read(fd, min(remaining, 1 << 20))
                        if not chunk:
                            break
                        out.write(chunk)
                        remaining -= len(chunk)
                paths.append(dest)
            except OSError:
                continue
            finally:
                os.close(fd)
        return paths

    def _copyable(self, st: os.stat_result) -> bool:
        """A regular, non-sparse file the code wrote, no larger than ``max_file_bytes``."""
        if not stat.S_ISREG(st.st_mode) or st.st_size > self.max_file_bytes:
            return False
        if st.st_blocks * 512 < st.st_size:
            return False  # sparse (holes cost the sandbox nothing, a full copy would not)
        return not (self._is_root and st.st_uid == 0)  # root-owned: not written by the code
