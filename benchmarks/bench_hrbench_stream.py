"""Memory benchmark: stream a multi-GB HR-Bench-style TSV with ``load_hrbench``.

Writes a TSV of ``--size-gb`` (default 5, like hr_bench_8k.tsv) in a temporary folder, each row
carrying a ~6 MB base64 payload of a real JPEG (random-noise pixels, padded after the JPEG end
marker to the target size), then iterates ``load_hrbench`` over it in a subprocess, reading every
image's header with PIL (no full decode). Reports the reader's peak RSS
(its ``ru_maxrss`` from ``wait4``; ``getrusage(RUSAGE_CHILDREN)`` would also take in the writer
subprocess, so both are printed, plus the reader's own VmHWM), rows/s and peak RSS / file size,
then deletes the file. The parent imports only the standard library, because a child's
``ru_maxrss`` starts from its parent's peak at fork/exec.

    python benchmarks/bench_hrbench_stream.py --size-gb 1
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEADER = "index\tquestion\tanswer\tcategory\tA\tB\tC\tD\tcycle_category\timage"
TARGET_RSS_MB = 300.0


def make_jpeg(raw_bytes: int) -> bytes:
    """A real JPEG of noise pixels (~95% of ``raw_bytes``), padded with zeros after its end
    marker to exactly ``raw_bytes`` (decoders stop at EOI)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    side = max(16, int((raw_bytes * 0.95 / 0.9) ** 0.5))  # noise at q90: ~0.9 byte / pixel
    while True:
        pixels = rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
        data = buf.getvalue()
        if len(data) <= raw_bytes:
            return data + b"\x00" * (raw_bytes - len(data))
        side = int(side * 0.9)


def write_tsv(path: Path, size_bytes: int, payload_b64_bytes: int) -> tuple[int, int, int]:
    """Write the TSV; return (rows, bytes written, bytes of the JPEG before its padding)."""
    raw = make_jpeg(payload_b64_bytes * 3 // 4)
    jpeg_bytes = len(raw.rstrip(b"\x00"))
    b64 = base64.b64encode(raw)
    rows = 0
    written = 0
    with path.open("wb") as f:
        head = (HEADER + "\r\n").encode()
        f.write(head)
        written += len(head)
        while written < size_bytes:
            text = (
                f"{rows}\tWhat is the colour of object {rows}?\t{'ABCD'[rows % 4]}\t"
                f"{'single' if rows % 2 == 0 else 'cross'}\tred\tblue\tgreen\twhite\t{rows % 4}\t"
            ).encode()
            f.write(text)
            f.write(b64)
            f.write(b"\r\n")
            written += len(text) + len(b64) + 2
            rows += 1
    return rows, written, jpeg_bytes


def _vm_hwm_mb() -> float | None:
    """This process's own peak RSS since exec (VmHWM), not inherited from the parent."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def writer(path: str, size: int, payload: int) -> None:
    """Run in a subprocess, so the numpy/PIL memory of writing stays out of the parent."""
    rows, written, jpeg_bytes = write_tsv(Path(path), size, payload)
    print(json.dumps({"rows": rows, "written": written, "jpeg_bytes": jpeg_bytes}))


def child(path: str) -> None:
    """Run in the subprocess: iterate the loader and read every image header."""
    from PIL import Image

    from speceyes.bench.datasets import load_hrbench

    start_mb = _vm_hwm_mb()
    t0 = time.perf_counter()
    rows = 0
    nbytes = 0
    sizes = set()
    for q in load_hrbench(path):
        with Image.open(io.BytesIO(q.image)) as im:  # header only, no decode
            sizes.add(im.size)
        nbytes += len(q.image)
        rows += 1
    dt = time.perf_counter() - t0
    res = {
        "rows": rows,
        "seconds": dt,
        "image_bytes": nbytes,
        "sizes": sorted(sizes),
        "hwm_after_imports_mb": start_mb,
        "hwm_end_mb": _vm_hwm_mb(),
    }
    print(json.dumps(res))


def _run_child(args: list[str], env: dict[str, str]) -> tuple[dict, float, float]:
    """Run ``python THIS_FILE args``; return its last JSON line, its own ru_maxrss (MB, via
    wait4) and the wall time."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, env=env)
    assert p.stdout is not None
    out = p.stdout.read().decode()
    p.stdout.close()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{args[0]} subprocess failed with exit code {p.returncode}")
    return json.loads(out.strip().splitlines()[-1]), ru.ru_maxrss / 1024, wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=5.0, help="TSV size in GB (1e9 bytes)")
    ap.add_argument("--payload-mb", type=float, default=6.0, help="base64 bytes per row, MB")
    ap.add_argument("--tmpdir", default=None, help="folder for the temporary TSV")
    ap.add_argument("--keep", action="store_true", help="do not delete the TSV")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--write", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child)
        return 0
    if args.write:
        writer(args.write[0], int(args.write[1]), int(args.write[2]))
        return 0

    # The parent stays lean (stdlib only): a child's ru_maxrss starts from its parent's peak.
    size = int(args.size_gb * 1e9)
    payload = int(args.payload_mb * 1e6) // 4 * 4
    tmp = Path(tempfile.mkdtemp(prefix="hrbench_stream_", dir=args.tmpdir))
    free = shutil.disk_usage(tmp).free
    if free < size + payload * 2:
        shutil.rmtree(tmp)
        print(f"not enough disk in {tmp.parent}: {free / 1e9:.1f} GB free", file=sys.stderr)
        return 2
    tsv = tmp / "hr_bench_synthetic.tsv"
    root = Path(__file__).resolve().parents[1]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p),
    )
    try:
        w, writer_mb, wall = _run_child(["--write", str(tsv), str(size), str(payload)], env)
        rows, written = w["rows"], w["written"]
        print(
            f"wrote {tsv} : {written / 1e9:.2f} GB, {rows} rows of {payload / 1e6:.1f} MB "
            f"base64 (a {w['jpeg_bytes'] / 1e6:.2f} MB JPEG, padded) in {wall:.1f} s "
            f"(writer peak RSS {writer_mb:.0f} MB)"
        )
        res, peak_mb, wall = _run_child(["--child", str(tsv)], env)
        all_children_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        parent_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if res["rows"] != rows:
            print(f"row count mismatch: wrote {rows}, read {res['rows']}", file=sys.stderr)
            return 1
        ratio = peak_mb * 1e6 / written
        print(f"rows read          : {res['rows']} (image sizes {res['sizes']})")
        print(
            f"loop time          : {res['seconds']:.1f} s  ({res['rows'] / res['seconds']:.1f}"
            f" rows/s, {written / 1e6 / res['seconds']:.0f} MB/s); subprocess wall {wall:.1f} s"
        )
        print(
            f"reader VmHWM       : {res['hwm_after_imports_mb']:.1f} MB after imports, "
            f"{res['hwm_end_mb']:.1f} MB at the end"
        )
        print(
            f"peak RSS (reader)  : {peak_mb:.1f} MB  [ru_maxrss of the reader; "
            f"RUSAGE_CHILDREN max over writer+reader {all_children_mb:.1f} MB; "
            f"parent {parent_mb:.1f} MB]"
        )
        print(f"peak RSS / file    : {ratio:.4f} ({peak_mb:.0f} MB / {written / 1e6:.0f} MB)")
        ok = peak_mb < TARGET_RSS_MB
        print(f"target < {TARGET_RSS_MB:.0f} MB   : {'PASS' if ok else 'FAIL'}")
        return 0 if ok else 1
    finally:
        if args.keep:
            print(f"kept {tsv}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
