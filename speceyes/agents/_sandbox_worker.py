"""Sandbox worker: runs ONE untrusted Python job in an isolated process, then exits.

Started by :class:`speceyes.agents.sandbox.Sandbox` as::

    python -I -S -B _sandbox_worker.py '<config json>'

This file is deliberately standalone (stdlib only, no ``speceyes`` imports) so that the
worker never loads anything from the project besides this one file.

Life cycle (everything before step 8 happens before the job is known):

1. unshare the network (+ mount and IPC when root) namespaces: the process only sees an
   unconfigured loopback interface, so ``connect()`` to any address fails;
2. pre-import the allowed modules (PIL + all its format plugins, numpy, math, ...) while the
   filesystem is still visible;
3. mount a size-limited private tmpfs on the work dir (root only) and ``chroot`` into it, so
   the host filesystem (/etc/passwd, the project's sources, ...) no longer exists;
4. drop privileges to a dedicated unprivileged uid/gid (root only), set no_new_privs and
   the parent-death signal;
5. set rlimits (address space, file size, open files, processes = 0, core = 0, stack), having
   joined a fresh empty session keyring before the uid drop, create (unarmed) the job's
   wall-clock timer, then install a seccomp filter that denies the keyring, SysV
   shm/msg/sem and memfd (memory RLIMIT_AS does not count), exec, clearing the parent-death
   signal, and the syscalls that could undo the isolation;
6. move the protocol pipe away from fd 1 (fd 1 and 2 then both go to the host's capped
   stderr drain) and answer ``ready`` to the host;
7. wait on stdin for the job (4-byte big-endian length + JSON);
8. arm the wall-clock timer (SIGKILL after ``worker_wall_seconds``; a second seccomp filter
   then forbids disarming it), set the CPU limit, run the code with a restricted
   ``__builtins__`` (import whitelist, path-checked ``open``) and ``sys.stdout``/``sys.stderr``
   captured in a bounded buffer;
9. answer the result frame, then block on stdin until the host (which copies the saved
   images out through ``/proc/<pid>/root``) kills the process group.

Only steps 1, 3, 4 and 5 are the security boundary.  The Python-level restrictions of step
8 are defence in depth and are easy to bypass (``().__class__.__base__.__subclasses__()``).
"""

from __future__ import annotations

import builtins
import ctypes
import io
import json
import linecache
import os
import resource
import signal
import struct
import sys
import traceback

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
KEYCTL_JOIN_SESSION_KEYRING = 1
SIGKILL = 9

# Seccomp denylist (EPERM), hand-written as classic BPF because this file must stay stdlib-only
# (it runs with -I -S before the chroot; no PyPI binding may load here) and the one PyPI binding
# for libseccomp is unmaintained. Denied: the kernel keyring (the host's keys), memory that
# RLIMIT_AS does not count (SysV shm/msg/sem, memfd), and syscalls that could undo the
# isolation or reach other processes. Numbers per architecture, from the kernel's tables.
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_DENIED = {  # name: (x86_64 number, aarch64 number)
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "shmget": (29, 194),
    "shmat": (30, 196),
    "shmctl": (31, 195),
    "msgget": (68, 186),
    "semget": (64, 190),
    "memfd_create": (319, 279),
    "memfd_secret": (447, 447),
    "mq_open": (240, 180),
    "userfaultfd": (323, 282),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "pidfd_getfd": (438, 438),
    "unshare": (272, 97),
    "setns": (308, 268),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "io_uring_setup": (425, 425),
    "kexec_load": (246, 104),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    # exec would drop the job's wall-clock timer (POSIX timers do not survive it); nothing in
    # the worker needs it once started.
    "execve": (59, 221),
    "execveat": (322, 281),
}  # fmt: skip
# Denied only with this first argument: prctl(PR_SET_PDEATHSIG, ...) would let the code clear
# its parent-death signal and outlive a killed host.
_DENIED_WITH_ARG0 = {"prctl": ((157, 167), PR_SET_PDEATHSIG)}  # fmt: skip
# Denied from the start of the job: disarming or deleting the job's wall-clock timer.
_DENIED_IN_JOB = {"timer_settime": (223, 110), "timer_delete": (226, 111)}  # fmt: skip
_ARCHES = ("x86_64", "aarch64")
DENIED_SYSCALLS = {
    arch: {name: numbers[i] for name, numbers in _DENIED.items()} for i, arch in enumerate(_ARCHES)
}
DENIED_WITH_ARG0 = {
    arch: {name: (nrs[i], arg0) for name, (nrs, arg0) in _DENIED_WITH_ARG0.items()}
    for i, arch in enumerate(_ARCHES)
}
DENIED_IN_JOB = {
    arch: {name: numbers[i] for name, numbers in _DENIED_IN_JOB.items()}
    for i, arch in enumerate(_ARCHES)
}
TIMER_CREATE = {"x86_64": 222, "aarch64": 107}
CLOCK_MONOTONIC = 1
SIGEV_SIGNAL = 0
X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 ABI: a second numbering, denied as a whole

CODE_FILENAME = "<sandbox>"

# Extra submodules pre-imported for an allowed top-level package (lazy imports cannot be
# resolved after the chroot, because the module files are no longer visible).
PRELOAD_EXTRA = {
    "PIL": (
        "PIL.Image",
        "PIL.ImageOps",
        "PIL.ImageFilter",
        "PIL.ImageEnhance",
        "PIL.ImageDraw",
        "PIL.ImageFont",
        "PIL.ImageChops",
        "PIL.ImageStat",
        "PIL.ImageColor",
        "PIL.ImageMath",
        "PIL.ImageSequence",
        "PIL.ImagePalette",
        "PIL.ImageTransform",
        "PIL.ImageMorph",
        "PIL.ExifTags",
        "PIL.TiffTags",
        "PIL.features",
    ),
    "numpy": (
        "numpy.linalg",
        "numpy.fft",
        "numpy.random",
        "numpy.polynomial",
        "numpy.ma",
        "numpy.lib.stride_tricks",
        "numpy.lib.format",
    ),
    "time": ("_strptime",),
    "datetime": ("_strptime",),
}
# Always pre-imported: codecs and helpers that the stdlib loads lazily.
PRELOAD_ALWAYS = (
    "encodings.utf_8",
    "encodings.utf_8_sig",
    "encodings.latin_1",
    "encodings.ascii",
    "encodings.utf_16",
    "encodings.utf_32",
    "encodings.cp1252",
    "encodings.raw_unicode_escape",
    "encodings.unicode_escape",
    "unicodedata",
)
# Never importable afterwards, even through the real ``__import__`` (defence in depth: once
# the chroot is in place nothing new can be loaded from disk anyway).
POISON_MODULES = (
    "socket",
    "_socket",
    "ssl",
    "_ssl",
    "multiprocessing",
    "_multiprocessing",
    "pty",
    "fcntl",
    "pwd",
    "grp",
    "shutil",
    "urllib",
    "http",
    "ftplib",
    "smtplib",
    "asyncio",
    "selectors",
    "mmap",
    "_posixshmem",
    "webbrowser",
    "code",
    "pdb",
    "importlib.util",
)
REMOVED_BUILTINS = (
    "breakpoint",
    "input",
    "help",
    "copyright",
    "credits",
    "license",
    "exit",
    "quit",
)


class OutputLimitExceeded(BaseException):  # noqa: N818  (shown to the model under this name)
    """Raised inside the user code when it prints far beyond the output cap."""


class BoundedWriter(io.TextIOBase):
    """Text sink that keeps the first ``cap`` bytes and stops the run at ``stop_at`` bytes."""

    def __init__(self, cap: int, stop_at: int):
        super().__init__()
        self.cap = cap
        self.stop_at = stop_at
        self.buf = bytearray()
        self.total = 0
        self.overflowed = False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    @property
    def errors(self) -> str:  # type: ignore[override]
        return "replace"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, s) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        n = len(s)
        if len(self.buf) < self.cap:
            data = s.encode("utf-8", "replace")
            self.buf += data[: self.cap - len(self.buf)]
            self.total += len(data)
        else:
            self.total += n  # (character count: good enough once we only count)
        if self.total > self.stop_at:
            self.overflowed = True
            raise OutputLimitExceeded(
                f"output limit exceeded: more than {self.stop_at} bytes printed"
            )
        return n

    def flush(self) -> None:
        pass


# --------------------------------------------------------------------------- framing


def write_frame(fd: int, obj: dict) -> None:
    data = json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass")
    data = struct.pack(">I", len(data)) + data
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def read_exact(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError("host closed the pipe")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> dict:
    (n,) = struct.unpack(">I", read_exact(fd, 4))
    return json.loads(read_exact(fd, n).decode("utf-8"))


# --------------------------------------------------------------------------- isolation


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _write_proc(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _drop_all_capabilities(libc) -> None:
    """capset(2) with empty sets (used after entering a user namespace as non-root)."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [
            ("effective", ctypes.c_uint32),
            ("permitted", ctypes.c_uint32),
            ("inheritable", ctypes.c_uint32),
        ]

    hdr = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (Data * 2)()
    _check(libc.capset(ctypes.byref(hdr), data), "capset")


def unshare_namespaces(libc, is_root: bool, iso: dict, want_netns: bool = True) -> None:
    if is_root:
        try:
            _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
            # private first, or our tmpfs mount would propagate to the host's namespace
            _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount private")
            iso["mountns"] = True
        except OSError as exc:
            iso["mountns_error"] = str(exc)
        libc.unshare(CLONE_NEWIPC)  # SysV IPC objects of the host: optional
        if want_netns:
            try:
                _check(libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
                iso["netns"] = True
            except OSError as exc:
                iso["netns_error"] = str(exc)
        return
    if not want_netns:
        return
    try:
        _check(libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        iso["netns"] = True
        return
    except OSError as exc:
        iso["netns_error"] = str(exc)
    # Unprivileged: a user namespace grants CAP_NET_ADMIN over a fresh network namespace.
    uid, gid = os.getuid(), os.getgid()
    try:
        _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNET), "unshare(CLONE_NEWUSER|CLONE_NEWNET)")
        _write_proc("/proc/self/setgroups", "deny")
        _write_proc("/proc/self/uid_map", f"{uid} {uid} 1")
        _write_proc("/proc/self/gid_map", f"{gid} {gid} 1")
        _drop_all_capabilities(libc)
        iso["netns"] = True
        iso["userns"] = True
    except OSError as exc:
        iso["netns_error"] += f"; {exc}"


def block_sockets_in_python() -> None:
    """Fallback when no network namespace could be created (documented as best effort).

    Poisons ``socket``/``_socket`` in ``sys.modules`` so that no import path (not even the
    real ``__import__`` reached through object-graph tricks) returns a working module.  Raw
    ``socket(2)`` calls through ``ctypes`` are NOT prevented by this.
    """

    class _NoNetwork:
        def __getattr__(self, name):
            raise PermissionError("network access is disabled in the sandbox")

        def __call__(self, *args, **kwargs):
            raise PermissionError("network access is disabled in the sandbox")

    for name in ("socket", "_socket", "ssl", "_ssl"):
        mod = sys.modules.get(name)
        if mod is not None:
            for attr in ("socket", "create_connection", "socketpair", "fromfd", "SocketType"):
                if hasattr(mod, attr):
                    try:
                        setattr(mod, attr, _NoNetwork())
                    except Exception:
                        pass
        sys.modules[name] = None  # type: ignore[assignment]
    # ctypes (pre-loaded by numpy) can issue raw socket(2)/connect(2) calls: remove its
    # library loaders.  Still best effort: without a network namespace or seccomp, code
    # that finds another route to native code can reach the network.
    for mod_name, attrs in (
        ("ctypes", ("CDLL", "PyDLL", "cdll", "pydll", "pythonapi", "LibraryLoader", "_dlopen")),
        ("_ctypes", ("dlopen", "dlsym", "dlclose")),
    ):
        mod = sys.modules.get(mod_name)
        for attr in attrs:
            if mod is not None and hasattr(mod, attr):
                try:
                    setattr(mod, attr, _NoNetwork())
                except Exception:
                    pass


def join_fresh_session_keyring(libc, iso: dict) -> None:
    """An empty anonymous session keyring instead of the host's (before the uid drop)."""
    nr = DENIED_SYSCALLS.get(os.uname().machine, {}).get("keyctl")
    if nr is None:
        return
    if libc.syscall(nr, KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        iso["keyring_error"] = os.strerror(ctypes.get_errno())
    else:
        iso["keyring"] = True


def seccomp_program(
    machine: str, denied: dict[str, int], denied_arg0: dict[str, tuple[int, int]]
) -> list[tuple[int, int, int, int]] | None:
    """Classic BPF: EPERM for the syscall numbers in ``denied`` and for those of
    ``denied_arg0`` called with that first argument (its low 32 bits: the kernel reads an
    ``int``); any other architecture's syscall kills the process. ``None``: unknown machine."""
    arch = AUDIT_ARCH.get(machine)
    if arch is None:
        return None
    ld_w_abs, jeq_k, jge_k, ret_k = 0x20, 0x15, 0x35, 0x06
    allow, kill = 0x7FFF0000, 0x80000000
    deny = 0x00050000 | 1  # SECCOMP_RET_ERRNO | EPERM
    nr_at, arg0_at = 0, 16  # offsets in struct seccomp_data (args[0], low word first)
    prog = [
        (ld_w_abs, 0, 0, 4),  # seccomp_data.arch
        (jeq_k, 1, 0, arch),
        (ret_k, 0, 0, kill),
        (ld_w_abs, 0, 0, nr_at),
    ]
    if machine == "x86_64":
        prog += [(jge_k, 0, 1, X32_SYSCALL_BIT), (ret_k, 0, 0, deny)]
    for nr in sorted(set(denied.values())):
        prog += [(jeq_k, 0, 1, nr), (ret_k, 0, 0, deny)]
    for nr, arg0 in sorted(set(denied_arg0.values())):
        prog += [
            (jeq_k, 0, 4, nr),  # another syscall: skip this rule (4 instructions)
            (ld_w_abs, 0, 0, arg0_at),
            (jeq_k, 0, 1, arg0),
            (ret_k, 0, 0, deny),
            (ld_w_abs, 0, 0, nr_at),  # the number again, for the rules below
        ]
    prog.append((ret_k, 0, 0, allow))
    return prog


def install_seccomp(
    libc,
    iso: dict,
    denied: dict[str, dict[str, int]] = DENIED_SYSCALLS,
    denied_arg0: dict[str, dict[str, tuple[int, int]]] = DENIED_WITH_ARG0,
    key: str = "seccomp",
) -> None:
    """Install a filter of :func:`seccomp_program` for this machine; ``iso[key]`` says
    whether it is in place (filters stack: a later one can only deny more).

    Needs no_new_privs (set before). Without a known architecture the filter is skipped and
    ``iso[key]`` stays False.
    """
    machine = os.uname().machine
    prog = seccomp_program(machine, denied.get(machine, {}), denied_arg0.get(machine, {}))
    if prog is None or machine not in denied:
        iso[f"{key}_error"] = f"no syscall table for {machine}"
        return

    class SockFilter(ctypes.Structure):
        _fields_ = [
            ("code", ctypes.c_ushort),
            ("jt", ctypes.c_ubyte),
            ("jf", ctypes.c_ubyte),
            ("k", ctypes.c_uint32),
        ]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    filters = (SockFilter * len(prog))(*[SockFilter(*ins) for ins in prog])
    fprog = SockFprog(len(prog), filters)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        iso[f"{key}_error"] = os.strerror(ctypes.get_errno())
    else:
        iso[key] = True


class _SigEvent(ctypes.Structure):  # struct sigevent (64 bytes on Linux)
    _fields_ = [
        ("value", ctypes.c_void_p),
        ("signo", ctypes.c_int),
        ("notify", ctypes.c_int),
        ("pad", ctypes.c_int * 12),
    ]


class _TimeSpec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class _ITimerSpec(ctypes.Structure):
    _fields_ = [("interval", _TimeSpec), ("value", _TimeSpec)]


def create_wall_timer(libc, iso: dict) -> int | None:
    """A POSIX timer on CLOCK_MONOTONIC that sends SIGKILL (unblockable, uncatchable) when
    it expires: the job's own wall-clock limit, armed by :func:`arm_wall_timer`. Timer id,
    or ``None`` when the kernel refused one (then ``iso["wall_timer_error"]`` says why)."""
    nr = TIMER_CREATE.get(os.uname().machine)
    if nr is None:
        iso["wall_timer_error"] = f"no syscall table for {os.uname().machine}"
        return None
    event = _SigEvent(None, SIGKILL, SIGEV_SIGNAL)
    timer = ctypes.c_int(-1)
    if libc.syscall(nr, CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
        iso["wall_timer_error"] = os.strerror(ctypes.get_errno())
        return None
    iso["wall_timer"] = True
    return timer.value


def arm_wall_timer(libc, timer: int, seconds: float, iso: dict) -> None:
    """Start the job's wall-clock timer, then deny disarming or deleting it (and exec, which
    would drop it, is denied from the start): from now on the worker dies ``seconds`` later
    whatever the code does, even if no host is left to kill it."""
    nr = DENIED_IN_JOB.get(os.uname().machine, {}).get("timer_settime")
    whole = int(max(0.001, seconds))
    frac = max(0.001, seconds) - whole
    spec = _ITimerSpec(_TimeSpec(0, 0), _TimeSpec(whole, int(frac * 1e9)))
    if nr is None or libc.syscall(nr, timer, 0, ctypes.byref(spec), None) != 0:
        iso["wall_timer_error"] = "cannot arm the wall-clock timer"
        return
    install_seccomp(libc, iso, DENIED_IN_JOB, {}, key="wall_timer")


def preimport(allowed: list[str]) -> list[str]:
    import importlib

    loaded = []
    for name in list(PRELOAD_ALWAYS):
        try:
            importlib.import_module(name)
        except Exception:
            pass
    for name in allowed:
        try:
            importlib.import_module(name)
        except Exception:
            continue  # optional (e.g. cv2 not installed)
        loaded.append(name)
        for extra in PRELOAD_EXTRA.get(name.split(".")[0], ()):
            try:
                importlib.import_module(extra)
            except Exception:
                pass
    if "PIL.Image" in sys.modules:
        image = sys.modules["PIL.Image"]
        image.preinit()
        image.init()  # imports every format plugin
        try:
            font = sys.modules["PIL.ImageFont"]
            font.load_default()
        except Exception:
            pass
        im = image.new("RGB", (4, 4))
        buf = io.BytesIO()
        im.save(buf, "PNG")
        im.save(io.BytesIO(), "JPEG")
        buf.seek(0)
        image.open(buf).load()
        if "numpy" in sys.modules:
            arr = sys.modules["numpy"].asarray(im)
            image.fromarray(arr)
    if "numpy" in sys.modules:
        np = sys.modules["numpy"]
        repr(np.arange(3.0))
        str(np.float64(1.5))
    "x".encode("latin-1").decode("cp1252")
    return loaded


def mount_tmpfs(libc, path: str, size_mb: int, gid: int) -> None:
    opts = f"size={int(size_mb)}m,nr_inodes=4096,mode=1770,uid=0,gid={gid}"
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    _check(libc.mount(b"tmpfs", path.encode(), b"tmpfs", flags, opts.encode()), "mount tmpfs")


def set_limits(cfg: dict, baseline_vm: int) -> None:
    def setlim(res, value):
        soft, hard = resource.getrlimit(res)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(res, (value, value))

    setlim(resource.RLIMIT_CORE, 0)
    setlim(resource.RLIMIT_NPROC, int(cfg["nproc"]))
    setlim(resource.RLIMIT_NOFILE, int(cfg["nofile"]))
    setlim(resource.RLIMIT_FSIZE, int(cfg["max_file_bytes"]))
    setlim(resource.RLIMIT_STACK, int(cfg["stack_bytes"]))
    setlim(resource.RLIMIT_MEMLOCK, 0)
    setlim(resource.RLIMIT_MSGQUEUE, 0)
    setlim(resource.RLIMIT_AS, baseline_vm + int(cfg["memory_mb"]) * 1024 * 1024)


def set_cpu_limit(cpu_seconds: float) -> None:
    """Precise CPU budget for the job: ITIMER_PROF (SIGPROF, default action: terminate)
    counts user+system time from now; RLIMIT_CPU (whole seconds) is the hard backstop that
    holds even if the code manages to ignore SIGPROF."""
    signal.signal(signal.SIGPROF, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_PROF, max(0.01, cpu_seconds))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    soft = int(used + cpu_seconds + 1.999)
    hard = soft + 1
    _, cur_hard = resource.getrlimit(resource.RLIMIT_CPU)
    if cur_hard != resource.RLIM_INFINITY:
        hard = min(hard, cur_hard)
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def vm_size_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


# --------------------------------------------------------------------------- user builtins


def make_builtins(allowed: list[str], loaded: list[str], root: str) -> dict:
    real_import = builtins.__import__
    real_open = builtins.open
    allowed_t = tuple(allowed)
    shown = ", ".join(sorted({a.split(".")[0] for a in loaded}))
    root_prefix = root.rstrip("/") + "/"

    def is_allowed(name: str) -> bool:
        return any(name == a or name.startswith(a + ".") for a in allowed_t)

    def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002
        if level:
            raise ImportError("relative imports are not allowed in the sandbox")
        if not isinstance(name, str) or not is_allowed(name):
            raise ImportError(
                f"import of {name!r} is not allowed in the sandbox (allowed modules: {shown})"
            )
        for item in fromlist or ():
            if isinstance(item, str) and item != "*":
                sub = f"{name}.{item}"
                if sub in sys.modules and not is_allowed(sub):
                    raise ImportError(f"import of {sub!r} is not allowed in the sandbox")
        try:
            return real_import(name, globals, locals, fromlist, level)
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                f"module {name!r} is not available in the sandbox ({exc})"
            ) from None

    def guarded_open(file, mode="r", *args, **kwargs):
        if isinstance(file, int):
            raise PermissionError("opening file descriptors is not allowed in the sandbox")
        path = os.path.realpath(os.fsdecode(file))
        if path != root and not path.startswith(root_prefix):
            raise PermissionError(
                f"access to {os.fsdecode(file)!r} is not allowed: only files in the sandbox "
                "work directory can be opened"
            )
        return real_open(file, mode, *args, **kwargs)

    ns = dict(builtins.__dict__)
    for name in REMOVED_BUILTINS + ("__loader__", "__spec__"):  # __loader__ loads posix
        ns.pop(name, None)
    ns["__import__"] = guarded_import
    ns["open"] = guarded_open
    return ns


# --------------------------------------------------------------------------- execution


def format_exception(exc: BaseException, max_lines: int = 20) -> str:
    tb = exc.__traceback__
    # Drop the worker's own frames: start at the first frame of the user code.
    while tb is not None and tb.tb_frame.f_code.co_filename != CODE_FILENAME:
        tb = tb.tb_next
    te = traceback.TracebackException(type(exc), exc, tb, compact=True)
    # Hide the sandbox's own helpers (guarded import/open) from the model.
    te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != __file__])
    text = "".join(te.format()).rstrip("\n").splitlines()
    if len(text) > max_lines:
        text = ["Traceback (most recent call last, truncated):"] + text[-(max_lines - 1) :]
    return "\n".join(text)


def run_job(job: dict, cfg: dict, user_builtins: dict) -> dict:
    code = job["code"]
    out = BoundedWriter(int(cfg["max_output_bytes"]), int(cfg["stop_output_bytes"]))
    g = {"__name__": "__main__", "__builtins__": user_builtins, "__doc__": None}
    if job.get("image_name") and job.get("var_name"):
        g[job["var_name"]] = job["image_name"]
    linecache.cache[CODE_FILENAME] = (len(code), None, code.splitlines(True), CODE_FILENAME)
    error = None
    ok = True
    sys.stdout = sys.stderr = out
    try:
        compiled = compile(code, CODE_FILENAME, "exec", dont_inherit=True)
        exec(compiled, g)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            ok = False
            error = f"SystemExit: {exc.code}"
    except OutputLimitExceeded:
        ok = False
    except MemoryError as exc:
        ok = False
        # Free the user's objects first: formatting the traceback needs some memory.
        traceback.clear_frames(exc.__traceback__)
        g.clear()
        error = f"Sandbox error: memory limit of {cfg['memory_mb']} MB exceeded."
        try:
            error += "\n" + format_exception(exc, 8)
        except MemoryError:
            pass
    except BaseException as exc:  # noqa: BLE001  (anything the user code raised)
        ok = False
        error = format_exception(exc)
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    if out.overflowed:
        ok = False
        error = (
            f"Sandbox error: output limit exceeded: the code printed more than "
            f"{out.stop_at} bytes and was stopped."
        )
    g = None
    return {
        "type": "result",
        "ok": ok,
        "error": error,
        "stdout": out.buf.decode("utf-8", "ignore"),
        "stdout_total": out.total,
    }


def main() -> None:
    cfg = json.loads(sys.argv[1])
    sys.path[:] = cfg["sys_path"]
    libc = _libc()
    is_root = os.geteuid() == 0
    iso: dict = {
        "netns": False,
        "mountns": False,
        "chroot": False,
        "tmpfs": False,
        "uid_dropped": False,
        "userns": False,
        "keyring": False,
        "seccomp": False,
        "wall_timer": False,
    }
    workdir = cfg["workdir"]

    # (``disable_netns`` exists only so the tests can exercise the no-netns fallback.)
    unshare_namespaces(libc, is_root, iso, want_netns=not cfg.get("disable_netns"))
    loaded = preimport(cfg["allowed"])
    if not iso["netns"]:
        block_sockets_in_python()
    baseline_vm = vm_size_bytes()

    join_fresh_session_keyring(libc, iso)
    if is_root:
        if iso["mountns"] and cfg["tmpfs_mb"]:
            try:
                mount_tmpfs(libc, workdir, cfg["tmpfs_mb"], cfg["gid"])
                iso["tmpfs"] = True
            except OSError as exc:
                iso["tmpfs_error"] = str(exc)
        os.chroot(workdir)
        os.chdir("/")
        iso["chroot"] = True
        root = "/"
        os.setgroups([])
        os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        try:
            os.setuid(0)
        except PermissionError:
            iso["uid_dropped"] = True
        else:
            raise RuntimeError("privilege drop failed: could setuid(0) again")
    else:
        os.chdir(workdir)
        root = os.path.realpath(workdir)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
    if os.getppid() != cfg["host_pid"]:
        os._exit(3)  # the host died while we were starting
    set_limits(cfg, baseline_vm)
    wall_timer = create_wall_timer(libc, iso)
    install_seccomp(libc, iso)
    needed = ("netns", "chroot", "uid_dropped", "seccomp", "keyring")
    if cfg.get("strict") and not all(iso.get(k) for k in needed):
        raise RuntimeError(f"strict sandbox requested but isolation is incomplete: {iso}")
    for name in POISON_MODULES:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]
    user_builtins = make_builtins(cfg["allowed"], loaded, root)

    reply_fd = os.dup(1)
    os.set_inheritable(reply_fd, False)
    os.dup2(2, 1)  # stray C-level writes to fd 1 go to the host's capped stderr drain
    iso["uid"] = os.getuid()
    iso["loaded"] = loaded
    write_frame(reply_fd, {"type": "ready", "pid": os.getpid(), "isolation": iso})

    job = read_frame(0)
    if wall_timer is not None:
        arm_wall_timer(libc, wall_timer, float(cfg["worker_wall_seconds"]), {})
    set_cpu_limit(float(cfg["cpu_seconds"]))
    result = run_job(job, cfg, user_builtins)
    write_frame(reply_fd, result)
    # Stay alive (idle) so the host can copy saved images out of our private tmpfs; the
    # host kills the process group afterwards.  EOF on stdin also ends us.
    try:
        os.read(0, 1)
    finally:
        os._exit(0)


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        os._exit(2)
