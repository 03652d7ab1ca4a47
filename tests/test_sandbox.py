"""Tests for the Thyme code sandbox (speceyes.agents.sandbox).

Every escape attempt below must FAIL, and must be safe for the machine running the tests
even if the sandbox were broken: fork attempts are bounded loops whose children exit at
once, allocations are refused by RLIMIT_AS, infinite loops are killed by the CPU/wall
limits, and everything the code could spawn lives in a process group the host kills.

Most escapes are written the way a real attacker would: the import whitelist is bypassed
first (``().__class__.__base__.__subclasses__()`` -> the real ``os`` / ``__import__``), so
the tests exercise the OS-level boundary (chroot, uid drop, rlimits, network namespace),
not the Python-level defence in depth.  Guarantees that need root (chroot, uid drop) or a
network namespace are skipped, with the reason, where the worker could not set them up.
"""

from __future__ import annotations

import ast
import ctypes
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from speceyes.agents._sandbox_worker import DENIED_IN_JOB, DENIED_SYSCALLS
from speceyes.agents.sandbox import Sandbox, SandboxResult, SandboxStartupError
from tests.test_images import _png_header_only, count_decodes

REPO = Path(__file__).resolve().parents[1]
SANDBOX_SOURCE = REPO / "speceyes" / "agents" / "sandbox.py"

# Reach the real os module and the real builtins without importing anything.
ESCAPE = (
    "OS = [c for c in ().__class__.__base__.__subclasses__()"
    " if c.__name__ == '_wrap_close'][0].__init__.__globals__\n"
    "B = OS['__builtins__']\n"
    "real_import = B['__import__']\n"
)
# Runs several attempts in one job; each must raise.  Prints {name: exception or SUCCEEDED}.
ATTEMPTS = (
    "outcomes = {}\n"
    "def attempt(name, fn):\n"
    "    try:\n"
    "        fn()\n"
    "        outcomes[name] = 'SUCCEEDED'\n"
    "    except Exception as exc:\n"
    "        outcomes[name] = type(exc).__name__\n"
)

LIMITS = dict(cpu_seconds=1.5, wall_seconds=3, memory_mb=512, max_output_bytes=4096)


@pytest.fixture(scope="module")
def sb():
    with Sandbox(pool_size=2, **LIMITS) as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def isolation(sb) -> dict:
    res = sb.run("print('probe')")
    assert res.ok, res.error
    return res.isolation


@pytest.fixture()
def image(tmp_path) -> Path:
    arr = np.zeros((48, 64, 3), dtype=np.uint8)
    arr[..., 0] = np.arange(64, dtype=np.uint8)[None, :] * 4
    arr[..., 1] = np.arange(48, dtype=np.uint8)[:, None] * 5
    path = tmp_path / "scene image.png"
    Image.fromarray(arr).save(path)
    return path


def need(isolation: dict, *layers: str) -> None:
    missing = [layer for layer in layers if not isolation.get(layer)]
    if missing:
        pytest.skip(
            f"isolation layer(s) {missing} unavailable here (need root / namespaces); "
            f"worker reported {isolation}"
        )


def assert_serves(sb: Sandbox) -> None:
    """After any failure the same Sandbox must still run a normal job."""
    res = sb.run("import math\nprint(math.factorial(5))")
    assert res.ok, res.error
    assert res.stdout == "120\n"


def all_denied(res: SandboxResult, expected: int) -> dict:
    assert res.ok, res.error
    outcomes = ast.literal_eval(res.stdout)  # never eval() what the sandbox printed
    assert len(outcomes) == expected, outcomes
    assert "SUCCEEDED" not in outcomes.values(), outcomes
    return outcomes


def failed(res: SandboxResult) -> str:
    assert not res.ok, f"expected failure, got {res}"
    assert res.error
    return res.error


# --------------------------------------------------------------------------- normal use


def test_crop_with_pil_returns_image(sb, image):
    name = Sandbox.image_name_in_sandbox(str(image))
    assert name == "scene_image.png"
    code = (
        "from PIL import Image\n"
        "import numpy as np\n"
        f"img = Image.open({name!r})\n"  # the literal name works ...
        "assert image_path == " + repr(name) + "\n"  # ... and so does the variable
        "crop = img.crop((10, 5, 30, 15))\n"
        "crop.save('crop.png')\n"
        "Image.fromarray(np.asarray(crop)[:, ::-1]).save('flipped.jpg', quality=95)\n"
        "print('saved', crop.size)\n"
    )
    res = sb.run(code, str(image))
    assert res.ok, res.error
    assert res.stdout == "saved (20, 10)\n"
    assert [Path(p).name for p in res.images] == ["crop.png", "flipped.jpg"]
    with Image.open(res.images[0]) as out, Image.open(image) as src:
        assert out.size == (20, 10)
        assert np.array_equal(np.asarray(out), np.asarray(src.crop((10, 5, 30, 15))))
    assert all(os.path.isfile(p) for p in res.images)
    assert res.elapsed > 0


def test_printed_text_and_common_libraries(sb):
    code = (
        "import math, json, re, random, statistics, collections, itertools, functools\n"
        "import numpy as np\n"
        "from PIL import ImageDraw, ImageFilter, ImageEnhance, ImageOps, Image\n"
        "im = Image.new('RGB', (32, 32), 'white')\n"
        "ImageDraw.Draw(im).rectangle((4, 4, 12, 12), outline='red', width=2)\n"
        "im = ImageEnhance.Contrast(ImageOps.grayscale(im.filter(ImageFilter.BLUR))).enhance(2)\n"
        "print(json.dumps({'pi': round(math.pi, 3)}), np.linalg.norm(np.ones(4)))\n"
        "print(statistics.mean([1, 2, 3]), re.sub('a', 'b', 'aa'), im.mode)\n"
        "print('héllo ✓')\n"
    )
    res = sb.run(code)
    assert res.ok, res.error
    assert res.stdout == '{"pi": 3.142} 2.0\n2 bb L\nhéllo ✓\n'
    assert res.images == []


def test_python_error_is_reported_as_traceback_tail(sb):
    res = sb.run("x = 1\ny = x / 0\n")
    err = failed(res)
    assert 'File "<sandbox>", line 2' in err
    assert err.splitlines()[-1] == "ZeroDivisionError: division by zero"
    assert "_sandbox_worker" not in err
    err = failed(sb.run("x = = 1"))
    assert "SyntaxError" in err


def test_jobs_do_not_share_state(sb):
    first = sb.run(
        "import math\nmath.leak = 1\nSECRET = 42\nopen('state.txt', 'w').write('x')\nprint('set')"
    )
    assert first.ok, first.error
    second = sb.run(
        "import math\n"
        "print(hasattr(math, 'leak'), 'SECRET' in globals())\n"
        "try:\n    open('state.txt')\n    print('file leaked')\n"
        "except FileNotFoundError:\n    print('no file')\n"
    )
    assert second.ok, second.error
    assert second.stdout == "False False\nno file\n"


def test_output_is_truncated_with_a_note(sb):
    res = sb.run("print('a' * 10000)")
    assert res.ok, res.error  # over the cap but under 10x: just truncated
    assert res.stdout.startswith("a" * 4096)
    assert "[output truncated: showing the first 4096 of 10001 bytes]" in res.stdout


def test_concurrent_runs(sb):
    results: list[SandboxResult] = []

    def job(i):
        results.append(sb.run(f"print({i} * 2)"))

    threads = [threading.Thread(target=job, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.stdout for r in results) == ["0\n", "2\n", "4\n"]


def test_cold_start_without_pool():
    with Sandbox(pool_size=0, **LIMITS) as cold:
        res = cold.run("print('cold')")
        assert res.ok and res.stdout == "cold\n", res.error
        out_dir = cold._output_dir
    assert not os.path.exists(out_dir)
    with pytest.raises(RuntimeError):
        cold.run("print(1)")


def test_full_isolation_when_root(isolation):
    if os.geteuid() != 0:
        pytest.skip("chroot / uid drop / mount namespace need root")
    for layer in ("netns", "mountns", "tmpfs", "chroot", "uid_dropped"):
        assert isolation[layer], isolation
    assert isolation["uid"] not in (0, os.getuid())


def test_strict_mode():
    if os.geteuid() == 0:
        with Sandbox(pool_size=0, strict=True, **LIMITS) as strict:
            res = strict.run("print('strict')")
            assert res.ok and res.stdout == "strict\n", res.error
    else:  # chroot + uid drop are impossible: strict refuses to start workers
        with Sandbox(pool_size=0, strict=True, **LIMITS) as strict:
            with pytest.raises(SandboxStartupError, match="isolation is incomplete"):
                strict.run("print('strict')")


# --------------------------------------------------------------------------- imports


DANGEROUS_MODULES = (
    "os",
    "sys",
    "subprocess",
    "ctypes",
    "socket",
    "importlib",
    "builtins",
    "shutil",
    "multiprocessing",
    "threading",
    "pathlib",
    "signal",
    "os.path",
)


def test_dangerous_imports_refused(sb):
    # `import ctypes` as the code's first statement: a clear error for the model
    for module in ("ctypes", "os"):
        err = failed(sb.run(f"import {module}\nprint('imported')"))
        assert f"import of {module!r} is not allowed" in err
    # every dangerous module, through `import`, `from ... import` and __import__
    code = ATTEMPTS + "env = {'__builtins__': __builtins__}\n"
    for m in DANGEROUS_MODULES:
        code += (
            f"attempt('import {m}', lambda: exec('import {m}', env))\n"
            f"attempt('from {m}', lambda: exec('from {m} import *', env))\n"
            f"attempt('__import__ {m}', lambda: __import__({m!r}))\n"
        )
    code += "print(outcomes)\n"
    outcomes = all_denied(sb.run(code), 3 * len(DANGEROUS_MODULES))
    assert set(outcomes.values()) == {"ImportError"}, outcomes


def test_import_refusals_then_serves(sb):
    failed(sb.run("from os import system"))
    failed(sb.run("from . import x"))
    assert_serves(sb)


# --------------------------------------------------------------------------- filesystem


def test_read_etc_passwd_fails(sb, isolation):
    err = failed(sb.run("print(open('/etc/passwd').read())"))
    assert "passwd" in err
    need(isolation, "chroot")
    res = sb.run(ESCAPE + "print(OS['open']('/etc/passwd', OS['O_RDONLY']))")
    assert "FileNotFoundError" in failed(res)
    assert "root:" not in res.stdout
    res = sb.run(ESCAPE + "print(sorted(OS['listdir']('/')))")
    assert res.ok and res.stdout == "[]\n", res  # the chroot is the empty work dir
    assert_serves(sb)


def test_read_project_source_fails(sb, isolation):
    path = str(SANDBOX_SOURCE)
    assert SANDBOX_SOURCE.is_file()
    err = failed(sb.run(f"print(open({path!r}).read())"))
    assert "not allowed" in err or "No such file" in err
    need(isolation, "chroot")
    res = sb.run(ESCAPE + f"print(B['open']({path!r}).read())")
    assert "FileNotFoundError" in failed(res)
    assert "class Sandbox" not in res.stdout
    assert_serves(sb)


def test_write_outside_work_dir_fails(sb, isolation, tmp_path):
    targets = [f"/tmp/speceyes-escape-{uuid.uuid4().hex}", str(tmp_path / "xyz")]
    err = failed(sb.run(f"open({targets[0]!r}, 'w').write('pwned')"))
    assert "not allowed" in err or "No such file" in err
    need(isolation, "chroot", "uid_dropped")
    code = ESCAPE + ATTEMPTS
    for i, target in enumerate(targets):
        parent = os.path.dirname(target)
        code += (
            f"attempt('open{i}', lambda: B['open']({target!r}, 'w').write('pwned'))\n"
            f"attempt('os.open{i}', lambda: OS['open']({target!r}, OS['O_CREAT'] | OS['O_WRONLY']))\n"
            f"attempt('mkdir{i}', lambda: OS['mkdir']({parent!r} + '/sub'))\n"
            f"attempt('dotdot{i}', lambda: B['open']('../../..' + {target!r}, 'w'))\n"
        )
    code += (
        # leaving the chroot needs CAP_SYS_CHROOT; regaining root needs CAP_SETUID
        "OS['mkdir']('jail')\n"
        "attempt('chroot', lambda: OS['chroot']('jail'))\n"
        "attempt('setuid', lambda: OS['setuid'](0))\n"
        "attempt('chmod-root', lambda: OS['chmod']('/', 0o777))\n"
        "print(outcomes)\n"
    )
    try:
        outcomes = all_denied(sb.run(code), 11)
        assert outcomes["chroot"] == outcomes["setuid"] == "PermissionError"
        for target in targets:
            assert not os.path.exists(target)
            assert not os.path.exists(os.path.dirname(target) + "/sub")
    finally:
        for target in targets:
            if os.path.exists(target):
                os.unlink(target)
    assert_serves(sb)


def test_input_image_cannot_be_modified_or_deleted(sb, isolation, image):
    original = image.read_bytes()
    need(isolation, "chroot", "uid_dropped")
    err = failed(sb.run("open(image_path, 'wb').write(b'x')", str(image)))
    assert "PermissionError" in err
    code = (
        ESCAPE + ATTEMPTS + "from PIL import Image\n"
        "attempt('overwrite', lambda: B['open'](image_path, 'r+b').write(b'x'))\n"
        f"attempt('host-path', lambda: B['open']({str(image)!r}, 'wb').write(b'x'))\n"
        "attempt('chmod', lambda: OS['chmod'](image_path, 0o666))\n"
        "attempt('chown', lambda: OS['chown'](image_path, OS['getuid'](), -1))\n"
        "attempt('unlink', lambda: OS['unlink'](image_path))\n"
        "attempt('rename', lambda: OS['rename'](image_path, 'moved.png'))\n"
        "attempt('replace', lambda: OS['replace']('/', image_path))\n"
        "attempt('pil-save', lambda: Image.new('RGB', (2, 2)).save(image_path))\n"
        "attempt('truncate', lambda: OS['truncate'](image_path, 0))\n"
        "print(outcomes)\n"
    )
    res = sb.run(code, str(image))
    outcomes = all_denied(res, 9)
    assert outcomes["unlink"] == outcomes["chmod"] == "PermissionError"
    assert res.images == []
    assert image.read_bytes() == original
    # ... while the code can still read it
    res = sb.run("print(len(open(image_path, 'rb').read()))", str(image))
    assert res.ok and res.stdout == f"{len(original)}\n", res
    assert_serves(sb)


def test_planted_symlinks_and_fifos_are_not_followed_by_the_host(sb, tmp_path):
    secret = tmp_path / "secret.png"
    Image.new("RGB", (3, 3), "red").save(secret)  # a real PNG: only O_NOFOLLOW protects it
    code = (
        ESCAPE + f"OS['symlink']({str(secret)!r}, 'evil.png')\n"
        "OS['symlink']('/etc/shadow', 'shadow.png')\n"
        "OS['mkfifo']('fifo.png')\n"
        "open('junk.png', 'w').write('not an image')\n"
        "from PIL import Image\nImage.new('RGB', (2, 2)).save('real.png')\n"
        "print('planted')"
    )
    t0 = time.monotonic()
    res = sb.run(code)
    assert res.ok, res.error
    assert [Path(p).name for p in res.images] == ["real.png"]
    assert time.monotonic() - t0 < 2.5  # opening the FIFO must not block the host
    assert_serves(sb)


# --------------------------------------------------------------------------- processes


def test_subprocess_system_fork_fail(sb, tmp_path):
    marker = tmp_path / "marker"
    cmd = f"touch {marker}"
    res = sb.run(ESCAPE + f"print(OS['system']({cmd!r}))")
    assert res.ok and res.stdout.strip() != "0", res  # system() could not spawn a shell
    err = failed(sb.run(ESCAPE + f"real_import('subprocess').run({cmd!r}, shell=True)"))
    assert "BlockingIOError" in err or "Resource temporarily unavailable" in err
    err = failed(sb.run(ESCAPE + "print(OS['fork']())"))
    assert "BlockingIOError" in err
    err = failed(sb.run(ESCAPE + "t = real_import('threading').Thread(target=print)\nt.start()"))
    assert "can't start new thread" in err
    assert not marker.exists()
    assert_serves(sb)


def test_fork_bomb_is_contained(sb):
    # Bounded on purpose: even if RLIMIT_NPROC failed, at most 200 short-lived children.
    code = ESCAPE + (
        "forked = 0\n"
        "try:\n"
        "    for _ in range(200):\n"
        "        if OS['fork']() == 0:\n"
        "            OS['_exit'](0)\n"
        "        forked += 1\n"
        "finally:\n"
        "    print('forked', forked)\n"
    )
    res = sb.run(code)
    assert res.stdout == "forked 0\n"
    assert "BlockingIOError" in failed(res)
    assert_serves(sb)


def test_cannot_signal_host_processes(sb, isolation):
    need(isolation, "uid_dropped")
    victim = subprocess.Popen(["sleep", "30"])
    try:
        code = ESCAPE + (
            f"for pid, sig in (({victim.pid}, 9), ({os.getpid()}, 0), (1, 0)):\n"
            "    try:\n"
            "        OS['kill'](pid, sig)\n"
            "        print('signalled', pid)\n"
            "    except PermissionError:\n"
            "        print('denied')\n"
        )
        res = sb.run(code)
        assert res.ok, res.error
        assert res.stdout == "denied\ndenied\ndenied\n"
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()
    assert_serves(sb)


# --------------------------------------------------------------------------- network


def test_network_connect_fails(sb, isolation):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(5)
    port = listener.getsockname()[1]
    try:
        err = failed(sb.run("import socket"))
        assert "not allowed" in err
        # real __import__: the module is poisoned / cannot be loaded in the chroot
        res = sb.run(ESCAPE + "s = real_import('socket')\nprint(s.create_connection)")
        assert "Error" in failed(res)
        # raw syscalls through ctypes (pre-loaded by numpy): only the netns stops these
        need(isolation, "netns")
        code = ESCAPE + (
            "import struct\n"
            "ct = real_import('sys').modules['ctypes']\n"
            "libc = ct.CDLL(None, use_errno=True)\n"
            "fd = libc.socket(2, 1, 0)\n"
            f"addr = struct.pack('<H', 2) + struct.pack('>H', {port}) + bytes([127, 0, 0, 1])"
            " + bytes(8)\n"
            "rc = libc.connect(fd, addr, 16)\n"
            "print('CONNECTED' if rc == 0 else 'refused: ' + OS['strerror'](ct.get_errno()))\n"
        )
        res = sb.run(code)
        assert res.ok, res.error
        assert res.stdout.startswith("refused: "), res.stdout
        assert "CONNECTED" not in res.stdout
        listener.settimeout(0.2)
        with pytest.raises((TimeoutError, BlockingIOError)):
            listener.accept()  # nobody ever reached us
    finally:
        listener.close()
    assert_serves(sb)


def test_no_netns_fallback_blocks_python_level_networking():
    """Fallback used where no network namespace can be created (e.g. no CAP_SYS_ADMIN):
    socket modules are poisoned and ctypes' library loaders removed.  Best effort only."""
    with Sandbox(pool_size=0, **LIMITS) as fb:
        fb._cfg["disable_netns"] = True  # test-only switch: skip unshare(CLONE_NEWNET)
        code = (
            ESCAPE
            + ATTEMPTS
            + (
                "sysm = real_import('sys')\n"
                "attempt('socket', lambda: real_import('socket').socket)\n"
                "attempt('_socket', lambda: real_import('_socket').socket)\n"
                "ct, _ct = sysm.modules.get('ctypes'), sysm.modules.get('_ctypes')\n"
                "if ct is not None:\n"
                "    attempt('CDLL', lambda: ct.CDLL(None).connect)\n"
                "    attempt('cdll', lambda: ct.cdll.LoadLibrary('libc.so.6').connect)\n"
                "    attempt('pythonapi', lambda: ct.pythonapi.connect)\n"
                "    attempt('dlopen', lambda: _ct.dlopen(None))\n"
                "print(outcomes)\n"
            )
        )
        res = fb.run(code)
        assert res.isolation["netns"] is False
        outcomes = all_denied(res, len(ast.literal_eval(res.stdout)))
        assert {"socket", "_socket"} <= set(outcomes)
        assert_serves(fb)


# --------------------------------------------------------------------------- limits


@pytest.mark.slow
def test_infinite_loop_hits_cpu_limit():
    # wall limit far away so that only the CPU limit can fire, even on a loaded machine
    with Sandbox(pool_size=0, cpu_seconds=1, wall_seconds=30, memory_mb=512) as cpu_sb:
        t0 = time.monotonic()
        res = cpu_sb.run("while True:\n    pass\n")
        elapsed = time.monotonic() - t0
        assert "time limit of 1 s exceeded (CPU time)" in failed(res)
        assert elapsed < 30
        assert_serves(cpu_sb)


@pytest.mark.slow
def test_wall_clock_timeout(sb):
    t0 = time.monotonic()
    res = sb.run("import time\nprint('start')\ntime.sleep(60)\n")
    elapsed = time.monotonic() - t0
    assert "time limit of 3 s exceeded (wall clock)" in failed(res)
    assert 2.9 < elapsed < LIMITS["wall_seconds"] + 1.5
    assert_serves(sb)


def test_allocate_20gb_is_a_memory_error(sb):
    err = failed(sb.run("x = bytearray(20 * 1024 ** 3)\nprint('allocated')"))
    assert err.startswith("Sandbox error: memory limit of 512 MB exceeded.")
    assert "MemoryError" in err
    code = ATTEMPTS + (
        "import numpy as np\n"
        "from PIL import Image\n"
        "attempt('numpy', lambda: np.ones(20 * 1024 ** 3, dtype=np.uint8))\n"
        "attempt('numpy-float', lambda: np.zeros((50000, 50000)))\n"
        "attempt('PIL', lambda: Image.new('RGB', (100000, 70000)))\n"
        "attempt('str', lambda: 'x' * (20 * 1024 ** 3))\n"
        "print(outcomes)\n"
    )
    outcomes = all_denied(sb.run(code), 4)
    assert set(outcomes.values()) <= {"MemoryError", "_ArrayMemoryError"}, outcomes
    assert_serves(sb)


@pytest.mark.slow
def test_gradual_memory_exhaustion():
    # own sandbox: small memory budget, generous wall limit (robust on a loaded machine)
    with Sandbox(pool_size=0, cpu_seconds=10, wall_seconds=30, memory_mb=128) as mem_sb:
        code = "chunks = []\nwhile True:\n    chunks.append(bytearray(4 * 2**20))\n"
        err = failed(mem_sb.run(code))
        assert "memory limit of 128 MB exceeded" in err
        assert_serves(mem_sb)


def test_print_1gb_is_bounded(sb):
    t0 = time.monotonic()
    res = sb.run("for _ in range(10**6):\n    print('x' * 1000)\n")  # 1 GB in total
    assert time.monotonic() - t0 < LIMITS["wall_seconds"]
    assert "output limit exceeded" in failed(res)
    assert res.stdout.startswith("x" * 1000)
    assert len(res.stdout) < 4096 + 200
    assert "[output truncated" in res.stdout
    # one single 1 GB string: refused by the memory limit or truncated, never buffered
    res = sb.run("print('y' * 10**9)")
    assert len(res.stdout) < 4096 + 200
    # catching the stop signal does not help: every further write stops again
    code = (
        "for _ in range(10**5):\n"
        "    try:\n        print('z' * 1000)\n"
        "    except BaseException:\n        pass\n"
    )
    res = sb.run(code)
    assert "output limit exceeded" in failed(res)
    assert len(res.stdout) < 4096 + 200
    assert_serves(sb)


def test_deep_recursion(sb):
    err = failed(sb.run("def f(n):\n    return f(n + 1)\nf(0)\n"))
    assert "RecursionError" in err
    # lifting the recursion limit through the real sys ends in a native stack overflow:
    # the worker dies (RLIMIT_STACK), the host reports it and keeps serving
    code = ESCAPE + (
        "real_import('sys').setrecursionlimit(10**8)\n"
        "import functools\n"
        "g = functools.lru_cache(None)(lambda n: g(n + 1))\n"
        "g(0)\n"
    )
    err = failed(sb.run(code))
    assert "crashed" in err or "RecursionError" in err or "MemoryError" in err
    assert_serves(sb)


def test_big_files_are_limited(sb):
    err = failed(sb.run(ESCAPE + "B['open']('big.png', 'wb').write(b'x' * (40 * 2**20))"))
    assert "File too large" in err  # RLIMIT_FSIZE (32 MB by default)
    assert_serves(sb)


def test_crashing_or_meddling_worker_is_replaced(sb):
    err = failed(sb.run(ESCAPE + "OS['kill'](OS['getpid'](), 9)"))
    assert "crashed (SIGKILL)" in err
    err = failed(sb.run(ESCAPE + "OS['_exit'](3)"))
    assert "exit code 3" in err
    # scribble over every fd that might be the protocol pipe
    code = ESCAPE + (
        "for fd in range(1, 20):\n"
        "    try:\n        OS['write'](fd, b'\\xff\\xff\\xff\\xff garbage')\n"
        "    except OSError:\n        pass\n"
    )
    res = sb.run(code)
    assert not res.ok
    # a pooled worker that dies while idle is discarded, not handed out
    assert sb.wait_ready(timeout=30)
    with sb._lock:
        idle = [w.pid for w in sb._ready]
    for pid in idle:
        os.kill(pid, 9)
    for pid in idle:  # wait until they are zombies (signal delivery is asynchronous)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
    assert_serves(sb)


def test_module_level_sanity():
    assert sys.platform == "linux"
    assert Sandbox.image_name_in_sandbox("/x/y/../weird name!.JPG") == "weird_name.jpg"
    assert Sandbox.image_name_in_sandbox("/x/.hidden") == "hidden.png"
    assert Sandbox.image_name_in_sandbox("/x/") == "input.png"


# --------------------------------------------------------------------------- kernel keyring, shared memory

SYSCALLS = DENIED_SYSCALLS.get(os.uname().machine, {})
# The code reaches ctypes (pre-loaded by numpy) through the object graph, then raw syscalls.
LIBC = ESCAPE + (
    "ct = real_import('sys').modules['ctypes']\n"
    "libc = ct.CDLL(None, use_errno=True)\n"
    "def sys_(name, *args):\n"
    f"    nr = {SYSCALLS!r}[name]\n"
    "    r = libc.syscall(nr, *args)\n"
    "    return r if r >= 0 else -ct.get_errno()\n"
)


def _host_add_key(desc: bytes, payload: bytes) -> int:
    """A "user" key in the test process's session keyring (KEY_SPEC_SESSION_KEYRING = -3)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(SYSCALLS["add_key"], b"user", desc, payload, len(payload), -3)


@pytest.mark.skipif(not SYSCALLS, reason="no syscall table for this architecture")
def test_host_keyring_is_out_of_reach(sb, isolation):
    assert isolation["keyring"] and isolation["seccomp"], isolation
    desc = f"speceyes-test-{uuid.uuid4().hex}".encode()
    host_key = _host_add_key(desc, b"top secret")
    code = LIBC + (
        "buf = ct.create_string_buffer(256)\n"
        f"found = sys_('request_key', b'user', {desc!r}, None, 0)\n"
        # KEYCTL_READ (11) of the host's key id; KEYCTL_INVALIDATE (21); KEYCTL_CLEAR (7) -3
        f"read = sys_('keyctl', 11, {host_key}, buf, 256)\n"
        f"gone = sys_('keyctl', 21, {host_key})\n"
        "cleared = sys_('keyctl', 7, -3)\n"
        "planted = sys_('add_key', b'user', b'planted', b'x', 1, -3)\n"
        "print([found, read, gone, cleared, planted], buf.raw[:10])\n"
    )
    res = sb.run(code)
    assert res.ok, res.error
    assert res.stdout.startswith("[-1, -1, -1, -1, -1]"), res.stdout  # all -EPERM
    assert b"top secret" not in res.stdout.encode()
    if host_key > 0:  # the host's key is untouched
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(64)
        n = libc.syscall(SYSCALLS["keyctl"], 11, host_key, buf, 64)
        assert buf.raw[:n] == b"top secret"
        libc.syscall(SYSCALLS["keyctl"], 21, host_key)
    assert_serves(sb)


def _shmem_kb() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Shmem:"))


@pytest.mark.skipif(not SYSCALLS, reason="no syscall table for this architecture")
def test_shared_memory_cannot_grow_past_the_memory_limit():
    mb = 300  # more than the sandbox's 128 MB
    code = (
        LIBC
        + (
            f"n = {mb} << 20\n"
            "shm = sys_('shmget', 0, n, 0o1600)\n"  # IPC_PRIVATE, IPC_CREAT | 0600
            "if shm >= 0:\n"
            "    libc.shmat.restype = ct.c_void_p\n"
            "    addr = libc.shmat(shm, None, 0)\n"
            "    ct.memset(addr, 1, n)\n"
            "    libc.shmdt(ct.c_void_p(addr))\n"
            "mfd = sys_('memfd_create', b'x', 0)\n"
            "if mfd >= 0:\n"
            "    chunk = b'x' * (1 << 20)\n"
            "    for _ in range(" + str(mb) + "):\n"
            "        OS['write'](mfd, chunk)\n"
            "print([shm, mfd])\n"
        )
    )
    with Sandbox(pool_size=0, memory_mb=128, cpu_seconds=5, wall_seconds=10) as sandbox:
        before = _shmem_kb()
        res = sandbox.run(code)
        grown_mb = (_shmem_kb() - before) / 1024
    assert res.ok, res.error
    assert res.stdout == "[-1, -1]\n", res.stdout  # both -EPERM
    assert grown_mb < 64, grown_mb


# --------------------------------------------------------------------------- copy-back, frames


def test_sparse_images_are_not_copied_back_and_copies_can_be_discarded(tmp_path):
    code = ESCAPE + (
        "for i in range(32):\n"  # 8 MB "PNGs" that allocate a page each
        "    with open(f'sparse{i}.png', 'wb') as f:\n"
        "        f.write(b'\\x89PNG\\r\\n\\x1a\\n')\n"
        "        f.seek((8 << 20) - 1)\n"
        "        f.write(b'\\0')\n"
        "from PIL import Image\n"
        "Image.new('RGB', (32, 32), 'red').save('real.png')\n"
    )
    out = tmp_path / "out"
    with Sandbox(pool_size=0, disk_mb=16, output_dir=str(out), **LIMITS) as sandbox:
        res = sandbox.run(code)
        assert res.ok, res.error
        assert [os.path.basename(p) for p in res.images] == ["real.png"]
        copied = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        assert copied < 1 << 20, copied
        res.discard()
        assert res.images == [] and not [p for p in out.rglob("*") if p.is_file()]


FORGE = ESCAPE + (
    "import json\n"
    "st = real_import('struct')\n"
    "def forge(data):\n"
    "    OS['write'](3, st.pack('>I', len(data)) + data)\n"
    "    OS['_exit'](0)\n"
)


@pytest.mark.parametrize(
    "payload",
    [
        b"[" * 200_000 + b"]" * 200_000,
        b'{"type": "result", "ok": true, "stdout": ' + b"[" * 50 + b"]" * 50 + b"}",
        b"\xff\xfe not json",
    ],
    ids=["deep", "nested-field", "bytes"],
)
def test_forged_frames_give_a_protocol_error(sb, payload):
    res = sb.run(FORGE + f"forge({payload!r})\n")
    assert "protocol" in failed(res)
    assert_serves(sb)


def test_forged_lone_surrogates_are_replaced(sb):
    frame = (
        b'{"type": "result", "ok": true, "error": null, "stdout": "a\\ud800b", "stdout_total": 3}'
    )
    res = sb.run(FORGE + f"forge({frame!r})\n")
    assert res.ok and res.stdout.replace("\ufffd", "") == "ab" and "\ufffd" in res.stdout, res
    res.stdout.encode("utf-8")  # valid text for any tokenizer


# --------------------------------------------------------------------------- host resources


def test_copy_back_holds_one_file_descriptor_at_a_time(monkeypatch):
    """Thousands of planted image-looking files: the host opens them one at a time (a planted
    file per fd would exhaust the host's descriptors and fail its other work with EMFILE).
    The descriptors counted are the ones the host opens on planted files and has not yet
    closed: a count of /proc/self/fd would also see other threads' work in this process."""
    code = (
        "for i in range(3000):\n"
        "    open('f%04d.png' % i, 'wb').write(b'\\x89PNG\\r\\n\\x1a\\n' + bytes(8))\n"
    )
    held: set[int] = set()
    peak = [0]
    opened = [0]
    real_open, real_close = os.open, os.close

    def counting_open(path, *args, **kwargs):
        fd = real_open(path, *args, **kwargs)
        if os.fspath(path).endswith(".png"):
            held.add(fd)
            opened[0] += 1
            peak[0] = max(peak[0], len(held))
        return fd

    def counting_close(fd):
        held.discard(fd)
        return real_close(fd)

    with Sandbox(pool_size=0, cpu_seconds=10, wall_seconds=30) as sandbox:
        monkeypatch.setattr(os, "open", counting_open)
        monkeypatch.setattr(os, "close", counting_close)
        res = sandbox.run(code)
        monkeypatch.undo()
        assert res.ok, res.error
        assert len(res.images) == 32  # the first MAX_IMAGES by mtime, as before
        assert opened[0] >= 32  # the count saw the copy-back's opens
        assert peak[0] == 1 and not held, (peak[0], held)
        res.discard()


HOST_THAT_DIES = """
import os, sys, threading, time
from speceyes.agents.sandbox import Sandbox
code = sys.argv[1]
sb = Sandbox(pool_size=0, cpu_seconds=5, wall_seconds=120)
threading.Thread(target=sb.run, args=(code,), daemon=True).start()
while True:  # wait until the code has run its prctl and written its marker
    for w in list(sb._workers):
        try:
            marker = open(f"/proc/{w.pid}/root/started").read()
        except OSError:
            continue
        print(w.pid, marker, flush=True)
        time.sleep(120)
    time.sleep(0.05)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # zombie: dead
    except OSError:
        return True


@pytest.mark.skipif(not SYSCALLS, reason="no syscall table for this architecture")
def test_worker_dies_with_a_killed_host():
    """The code clears its parent-death signal and sleeps; the host is SIGKILLed."""
    code = LIBC + (
        "r = libc.prctl(1, 0, 0, 0, 0)\n"  # PR_SET_PDEATHSIG = 0
        "OS['write'](OS['open']('started', 0o101), str(r).encode())\n"  # O_WRONLY | O_CREAT
        "real_import('time').sleep(100)\n"
    )
    host = subprocess.Popen(
        [sys.executable, "-c", HOST_THAT_DIES, code],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    worker = None
    try:
        line = host.stdout.readline().split()
        assert line, "the host never saw its worker start"
        worker, prctl_result = int(line[0]), line[1]
        host.kill()
        host.wait()
        deadline = time.monotonic() + 5
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(worker), "the worker outlived its SIGKILLed host"
        assert prctl_result == "-1"  # clearing the parent-death signal was refused
    finally:
        host.kill()
        if worker is not None and not _gone(worker):
            os.kill(worker, 9)


@pytest.mark.skipif(not SYSCALLS, reason="no syscall table for this architecture")
def test_worker_enforces_its_own_wall_limit():
    """Past its own wall limit the worker is killed by a timer the code cannot disarm, even
    when the host does not kill it (here: the host's limit is far away)."""
    numbers = DENIED_IN_JOB[os.uname().machine]
    disarm = LIBC + (
        "sig = real_import('signal')\n"
        "sig.setitimer(sig.ITIMER_REAL, 0)\n"
        "sig.pthread_sigmask(sig.SIG_BLOCK, sig.valid_signals())\n"
        "zero = ct.create_string_buffer(32)\n"  # struct itimerspec of zeros: disarm
        "tried = []\n"
        "for timer in range(4):\n"  # -errno of each call; the job's timer is among them
        f"    libc.syscall({numbers['timer_settime']}, timer, 0, zero, None)\n"
        "    tried.append(-ct.get_errno())\n"
        f"    libc.syscall({numbers['timer_delete']}, timer)\n"
        "    tried.append(-ct.get_errno())\n"
        "print(tried)\n"
    )
    with Sandbox(pool_size=0, cpu_seconds=5, wall_seconds=12) as sandbox:
        res = sandbox.run(disarm)
        assert res.ok and res.stdout == str([-1] * 8) + "\n", res  # all EPERM
        sandbox._cfg["worker_wall_seconds"] = 1.0  # the worker's limit, normally wall + grace
        t0 = time.monotonic()
        res = sandbox.run(disarm + "real_import('time').sleep(60)\n")
        elapsed = time.monotonic() - t0
    assert "time limit" in failed(res) and "wall clock" in res.error, res.error
    assert elapsed < 6, elapsed


def test_returned_images_are_decoded_only_while_the_agent_has_room(tmp_path, monkeypatch):
    """CodeAgent decodes no more returned images than it may still show, each one checked
    against the pixel limit from its header first."""
    from speceyes.agents.code import CodeAgent

    decodes = count_decodes(monkeypatch)

    paths = []
    for i in range(5):
        Image.new("RGB", (64, 64), (i, 0, 0)).save(tmp_path / f"crop{i}.png")
        paths.append(str(tmp_path / f"crop{i}.png"))
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(_png_header_only(9400, 9400))
    agent = SimpleNamespace(
        backend=SimpleNamespace(factor=28, min_pixels=4 * 28 * 28, max_pixels=1280 * 28 * 28),
        max_images=3,
    )
    images, problem = CodeAgent._images(agent, SimpleNamespace(images_shown=1, case_id="q"), paths)
    assert problem is None and len(images) == 2
    assert len(decodes) == 2  # room for two: the other three are never decoded
    images, problem = CodeAgent._images(agent, SimpleNamespace(images_shown=3, case_id="q"), paths)
    assert images == [] and "image limit reached" in problem
    assert len(decodes) == 2
    loop = SimpleNamespace(images_shown=0, case_id="q")
    images, problem = CodeAgent._images(agent, loop, [str(bomb)] * 32)
    assert images == [] and "too large to decode" in problem, problem
    assert len(decodes) == 2  # refused on its header
