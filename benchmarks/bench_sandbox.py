"""Start-to-result overhead of the Thyme code sandbox, cold vs warm.

    python benchmarks/bench_sandbox.py [-n 30]

* cold: ``Sandbox(pool_size=0)``: every ``run`` spawns a worker (interpreter start, imports
  of numpy/PIL, namespaces, chroot, privilege drop) and then executes ``print(1)``;
* warm: ``Sandbox(pool_size=2)``: the pool is pre-filled; before each measured ``run`` we
  wait until the background refill is complete, so the number is the latency a caller sees
  when a worker is ready (target: <= 50 ms).

``--planted N`` also runs one job that saves N tiny image-looking files (the tmpfs holds up
to 4096) and reports what copying them back costs the host: its peak of open file
descriptors (counted at every ``os.open``) and the job's time; 32 images come back.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from speceyes.agents.sandbox import Sandbox

CODE = "print(1)"


def _measure(sb: Sandbox, n: int, warm: bool) -> list[float]:
    times = []
    for _ in range(n):
        if warm and not sb.wait_ready(timeout=60):
            raise RuntimeError("pool did not refill")
        t0 = time.perf_counter()
        res = sb.run(CODE)
        times.append((time.perf_counter() - t0) * 1000.0)
        if not res.ok or res.stdout != "1\n":
            raise RuntimeError(f"unexpected result: {res}")
    return times


def _planted(n: int) -> None:
    code = (
        f"for i in range({n}):\n"
        "    open('f%04d.png' % i, 'wb').write(b'\\x89PNG\\r\\n\\x1a\\n' + bytes(8))\n"
    )
    real_open, peak = os.open, [0]

    def counting_open(*args, **kwargs):
        peak[0] = max(peak[0], len(os.listdir("/proc/self/fd")))
        return real_open(*args, **kwargs)

    with Sandbox(pool_size=0, cpu_seconds=20, wall_seconds=60) as sb:
        t0 = time.perf_counter()
        res = sb.run(code)  # timed without the counting (it lists /proc/self/fd per open)
        elapsed = time.perf_counter() - t0
        res.discard()
        baseline = len(os.listdir("/proc/self/fd"))
        os.open = counting_open
        try:
            res = sb.run(code)
        finally:
            os.open = real_open
        copied = len(res.images)
        res.discard()
    if not res.ok:
        raise RuntimeError(f"unexpected result: {res}")
    print(
        f"{n} planted files: {copied} copied back, host fds {baseline} -> peak "
        f"{peak[0]} (+{peak[0] - baseline}), job {elapsed * 1000:.0f} ms"
    )


def _p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-n", type=int, default=30, help="executions per mode")
    ap.add_argument("--planted", type=int, default=0, help="also plant N files (see above)")
    args = ap.parse_args()

    with Sandbox(pool_size=0) as sb:
        _measure(sb, 1, warm=False)  # page cache / first import warm-up
        cold = _measure(sb, args.n, warm=False)
    with Sandbox(pool_size=2) as sb:
        _measure(sb, 2, warm=True)
        warm = _measure(sb, args.n, warm=True)
        iso = sb.run(CODE).isolation

    cm, wm = statistics.median(cold), statistics.median(warm)
    cp, wp = _p95(cold), _p95(warm)
    print(f"sandbox start-to-result overhead, `{CODE}`, N={args.n} each")
    print(f"isolation: {iso}")
    print(f"{'':8}{'median ms':>12}{'p95 ms':>12}")
    print(f"{'cold':8}{cm:12.1f}{cp:12.1f}")
    print(f"{'warm':8}{wm:12.1f}{wp:12.1f}")
    print(f"{'ratio':8}{cm / wm:11.1f}x{cp / wp:11.1f}x   (cold / warm)")
    print(f"warm median target <= 50 ms: {'OK' if wm <= 50 else 'MISSED'}")
    if args.planted:
        _planted(args.planted)


if __name__ == "__main__":
    main()
