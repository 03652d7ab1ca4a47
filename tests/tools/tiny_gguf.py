"""Tiny Qwen-VL models as GGUF files, for testing against a real llama.cpp server offline.

A test tool, not part of the package: it fetches llama.cpp's converter at set-up time.

A tiny random checkpoint with the real Qwen vocabulary (``speceyes.tiny``, ``vocab="qwen"``: the
converter only accepts tokenizers it recognises) is converted twice with llama.cpp's own
``convert_hf_to_gguf.py``: once for the text model and once with ``--mmproj`` for the vision
encoder and projector.

The converter is not in llama-cpp-python's wheel but in its source distribution
(``vendor/llama.cpp``: the script, its ``conversion`` package and the matching ``gguf-py``).
``ensure_converter`` finds an extracted copy, or downloads the sdist of the installed
llama-cpp-python version with pip (the package registry, nothing else) and extracts those parts
into the cache folder (``$SPECEYES_CACHE`` or ``~/.cache/speceyes``). ``$SPECEYES_LLAMA_CPP_DIR``
may point at any llama.cpp checkout instead. The converter imports ``sentencepiece`` (only to
find that there is no SentencePiece model here), so that package must be installed.

Command line: ``python -m tests.tools.tiny_gguf OUT_DIR [--family qwen3_vl]`` builds the files and
prints the llama-cpp-python server command that serves them; ``--fetch-converter-only`` just
caches the converter (a setup step, so that tests need no download).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

from speceyes.tiny import Family, build_tiny_model

CONVERTER = "convert_hf_to_gguf.py"
# What the converter needs next to it, inside the sdist's vendor/llama.cpp.
_PARTS = (CONVERTER, "conversion", "gguf-py")


class ConverterError(RuntimeError):
    """llama.cpp's converter could not be found, fetched, or failed; the message says why."""


def cache_dir() -> Path:
    return Path(os.environ.get("SPECEYES_CACHE") or Path.home() / ".cache" / "speceyes")


def llama_cpp_version() -> str | None:
    """The installed llama-cpp-python version, or None."""
    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None


def _complete(folder: Path) -> bool:
    return all((folder / p).exists() for p in _PARTS)


def find_converter(version: str | None = None) -> Path | None:
    """The folder holding ``convert_hf_to_gguf.py`` (and its parts), or None if not found."""
    env = os.environ.get("SPECEYES_LLAMA_CPP_DIR")
    if env:
        return Path(env) if _complete(Path(env)) else None
    version = version or llama_cpp_version()
    candidates = [cache_dir() / f"llama.cpp-{version}"] if version else []
    # Without a pinned version, any cached copy will do (newest name last).
    candidates += sorted(cache_dir().glob("llama.cpp-*"), reverse=True)
    return next((c for c in candidates if _complete(c)), None)


def fetch_converter(version: str | None = None, timeout: float = 600) -> Path:
    """Download llama-cpp-python's sdist with pip and extract the converter into the cache."""
    version = version or llama_cpp_version()
    spec = f"llama-cpp-python=={version}" if version else "llama-cpp-python"
    with tempfile.TemporaryDirectory(prefix="speceyes-sdist-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--disable-pip-version-check", "-q", "-d", tmp, spec,
        ]  # fmt: skip
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=timeout)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            raise ConverterError(
                f"could not download the {spec} source distribution with pip (it carries "
                f"llama.cpp's {CONVERTER}): {detail.strip()[-500:]}"
            ) from e
        archives = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not archives:
            raise ConverterError(f"pip downloaded no llama_cpp_python-*.tar.gz for {spec}")
        return _extract(archives[-1])


def _extract(archive: Path) -> Path:
    name = archive.name.removesuffix(".tar.gz")  # llama_cpp_python-0.3.36
    version = name.split("-", 1)[1]
    dest = cache_dir() / f"llama.cpp-{version}"
    staging = Path(tempfile.mkdtemp(prefix="llama.cpp-", dir=_mkdir(cache_dir())))
    prefix = f"{name}/vendor/llama.cpp/"
    with tarfile.open(archive) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix)
            and m.name[len(prefix) :].split("/", 1)[0] in _PARTS
            and (m.isfile() or m.isdir())
        ]
        for m in members:
            m.name = m.name[len(prefix) :]
        # The "data" filter refuses absolute paths, links out of the folder and device files.
        tar.extractall(staging, members=members, filter="data")
    if not _complete(staging):
        shutil.rmtree(staging, ignore_errors=True)
        raise ConverterError(f"{archive.name} does not contain vendor/llama.cpp/{CONVERTER}")
    if dest.exists():  # another process won the race: keep its copy
        shutil.rmtree(staging, ignore_errors=True)
    else:
        staging.rename(dest)
    return dest


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def ensure_converter(version: str | None = None) -> Path:
    """A usable converter folder: a cached or configured copy, else fetched with pip."""
    return find_converter(version) or fetch_converter(version)


def _convert_cmd(hf_dir: Path, outfile: Path, mmproj: bool, outtype: str, folder: Path):
    cmd = [sys.executable, str(folder / CONVERTER), str(hf_dir), "--outfile", str(outfile)]
    return cmd + ["--outtype", outtype] + (["--mmproj"] if mmproj else [])


def _converter_env() -> dict[str, str]:
    # The converter loads config/tokenizer with transformers: never let it reach a hub.
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _check(proc: subprocess.CompletedProcess, hf_dir: Path, outfile: Path, mmproj: bool) -> Path:
    if proc.returncode != 0 or not outfile.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise ConverterError(
            f"{CONVERTER}{' --mmproj' if mmproj else ''} failed on {hf_dir} "
            f"(exit {proc.returncode}):\n{tail}"
        )
    return outfile


def convert(
    hf_dir: str | Path,
    outfile: str | Path,
    *,
    mmproj: bool = False,
    outtype: str = "f16",
    converter: str | Path | None = None,
    timeout: float = 600,
) -> Path:
    """Run ``convert_hf_to_gguf.py`` on a local checkpoint; returns the written file."""
    folder = Path(converter) if converter else ensure_converter()
    hf_dir, outfile = Path(hf_dir), Path(outfile)
    cmd = _convert_cmd(hf_dir, outfile, mmproj, outtype, folder)
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=_converter_env()
        )
    except subprocess.TimeoutExpired as e:
        raise ConverterError(f"{CONVERTER} timed out after {timeout:g} s on {hf_dir}") from e
    return _check(proc, hf_dir, outfile, mmproj)


def convert_both(
    hf_dir: str | Path,
    model_out: str | Path,
    mmproj_out: str | Path,
    *,
    outtype: str = "f16",
    converter: str | Path | None = None,
    timeout: float = 600,
) -> tuple[Path, Path]:
    """Text model and projector, converted side by side (each run is mostly imports)."""
    folder = Path(converter) if converter else ensure_converter()
    hf_dir = Path(hf_dir)
    jobs = [(Path(model_out), False), (Path(mmproj_out), True)]
    procs = [
        subprocess.Popen(
            _convert_cmd(hf_dir, out, mm, outtype, folder),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_converter_env(),
        )
        for out, mm in jobs
    ]
    results = []
    try:
        for (out, mm), proc in zip(jobs, procs, strict=True):
            try:
                stdout, stderr = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired as e:
                raise ConverterError(
                    f"{CONVERTER} timed out after {timeout:g} s on {hf_dir}"
                ) from e
            done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
            results.append(_check(done, hf_dir, out, mm))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results[0], results[1]


def build_tiny_gguf(
    out_dir: str | Path,
    family: Family = "qwen2_5_vl",
    *,
    seed: int = 0,
    lm_head_scale: float = 1.0,
    text_hidden: int = 64,
    text_layers: int = 2,
    vision_hidden: int = 32,
    vision_depth: int = 3,
    outtype: str = "f16",
    converter: str | Path | None = None,
) -> tuple[Path, Path]:
    """Build a tiny ``family`` checkpoint and convert it: returns (model.gguf, mmproj.gguf).

    The vision encoder needs at least 3 blocks: with 2, llama.cpp's converter mistakes the
    projector's ``visual.merger.mlp.2`` for a block and fails. Files already built in ``out_dir``
    with the same settings are reused.
    """
    if vision_depth < 3:
        raise ValueError(f"vision_depth must be at least 3 for llama.cpp, got {vision_depth}")
    out = _mkdir(Path(out_dir))
    tag = f"{family}-s{seed}-h{text_hidden}x{text_layers}-v{vision_hidden}x{vision_depth}"
    tag += f"-x{lm_head_scale:g}-{outtype}"
    model_gguf, mmproj_gguf = out / f"{tag}.gguf", out / f"{tag}-mmproj.gguf"
    if model_gguf.is_file() and mmproj_gguf.is_file():
        return model_gguf, mmproj_gguf
    folder = Path(converter) if converter else ensure_converter()
    hf_dir = build_tiny_model(
        out / f"{tag}-hf",
        family,
        text_hidden=text_hidden,
        text_layers=text_layers,
        vision_hidden=vision_hidden,
        vision_depth=vision_depth,
        seed=seed,
        lm_head_scale=lm_head_scale,
        vocab="qwen",
    )
    # Written under temporary names first: a half-written file is never taken as built.
    tmp_model, tmp_mmproj = out / f".{tag}.gguf.part", out / f".{tag}-mmproj.gguf.part"
    convert_both(hf_dir, tmp_model, tmp_mmproj, outtype=outtype, converter=folder)
    tmp_model.rename(model_gguf)
    tmp_mmproj.rename(mmproj_gguf)
    return model_gguf, mmproj_gguf


def server_command(model: Path, mmproj: Path, port: int = 8000, n_ctx: int = 4096) -> list[str]:
    """The llama-cpp-python server command that serves a model with its projector and logprobs."""
    return [
        sys.executable, "-m", "llama_cpp.server",
        "--model", str(model), "--clip_model_path", str(mmproj),
        "--chat_format", "mtmd", "--logits_all", "true", "--n_ctx", str(n_ctx),
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.tools.tiny_gguf", description=__doc__)
    ap.add_argument("out_dir", type=Path, nargs="?", help="where to write the GGUF files")
    ap.add_argument("--family", choices=["qwen2_5_vl", "qwen3_vl"], default="qwen2_5_vl")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lm-head-scale", type=float, default=1.0)
    ap.add_argument(
        "--fetch-converter-only",
        action="store_true",
        help="only make sure llama.cpp's converter is in the cache",
    )
    args = ap.parse_args(argv)
    if args.out_dir is None and not args.fetch_converter_only:
        ap.error("OUT_DIR is required unless --fetch-converter-only is given")
    try:
        folder = ensure_converter()
        if args.fetch_converter_only:
            print(folder)
            return 0
        model, mmproj = build_tiny_gguf(
            args.out_dir,
            args.family,
            seed=args.seed,
            lm_head_scale=args.lm_head_scale,
            converter=folder,
        )
    except (ConverterError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(model)
    print(mmproj)
    print(" ".join(server_command(model, mmproj)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
