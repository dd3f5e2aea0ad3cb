#!/usr/bin/env python3
"""Stage the GPU tier's software onto an offline GPU host: CUDA vLLM and the packages the host lacks, in chunks.

  python3 tools/stage_gpu.py pack OUTDIR [--chunk-mib N]
      Here, with the package index: downloads the "#gpu-stage" pins of constraints.txt as CPython 3.12 manylinux
      x86_64 wheels (--no-deps), unzips them into one site tree less vLLM's optional libraries, packs it as one
      tar.xz and splits it into OUTDIR/c1, OUTDIR/c2, ...: one part, a MANIFEST and a copy of this tool each.
  python3 CHUNKDIR/stage_gpu.py install CHUNKDIR PREFIX [--tree DIR]
      There, offline, from the checkout's root (DIR, default .): keeps the chunk's part under PREFIX/parts; once every
      part is there, checks sha256, extracts PREFIX/site, makes the venv PREFIX/venv over the host's packages,
      installs the lorafleet packages from the tree (editable, no dependencies) and runs `check`. Once per chunk,
      in any order; the last line is GPU_PYTHON=PREFIX/venv/bin/python once complete.
  python3 tools/stage_gpu.py check [--python PY] [--under DIR]
      Imports every module the GPU tier needs in one PY process and lists all that fail, then the console scripts
      missing next to PY and the requirements of installed packages that nothing installed meets.

Standard library only. docs/guides/gpu-processes.md#staging-onto-an-offline-gpu-host.
"""

from __future__ import annotations

import argparse
import configparser
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

PIN_TAG = "#gpu-stage "
MIB = 1024 * 1024
CARRY_LIMIT_MIB = 64  # what one call to the GPU host carries: the chunk plus the working tree
CARRY_TARGET_MIB = 60  # the default chunk leaves this much for both
PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_5_x86_64")
# vLLM's optional libraries, left out (a dense model with LoRA serves without them; they would add two chunks):
# FlashAttention-2's kernels, the fused MoE kernels, the vllm-rs binary and the headers of JIT kernel builds.
LEFT_OUT = ("vllm/vllm_flash_attn/_vllm_fa2_C*.so", "vllm/_moe_C*.so", "vllm/vllm-rs",
            "vllm/third_party/deep_gemm/include", "vllm/third_party/fmha_sm100/cutlass")
# The lorafleet packages, installed from the carried tree rather than packed: always the tree's own code.
TREE_PACKAGES = ("shared", "ops", "services/proxy", "services/vllm", "services/trainer", "tests/support")
MODULES = ("torch", "transformers", "peft", "accelerate", "vllm", "vllm.entrypoints.openai.api_server", "trl",
           "datasets", "math_verify", "latex2sympy2_extended", "liger_kernel", "fastapi", "uvicorn", "httptools",
           "orjson", "uvloop", "httpx", "aiohttp", "requests", "prometheus_client", "matplotlib", "pytest",
           "pytest_asyncio", "pytest_timeout", "hypothesis", "gguf", "lorafleet", "lorafleet_ops.commands.cli",
           "lorafleet_ops.processes", "lorafleet_proxy.app", "lorafleet_proxy.main", "lorafleet_vllm.main",
           "lorafleet_trainer.main", "lorafleet_testing.process_tier")
SCRIPTS = ("vllm", "lorafleet-replica", "lorafleet-proxy", "lorafleet-train", "lorafleet")


class StageError(Exception):
    """A refusal, with what to do about it."""


def stage_pins(constraints: str) -> list[str]:
    """The "#gpu-stage" lines of constraints.txt as pins; a bare name takes its pin from the file's own pins."""
    pinned = {}
    for line in constraints.splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and not line.startswith("#"):
            pinned[canonical(name)] = f"{name}=={version}"
    pins = []
    for line in constraints.splitlines():
        if not line.startswith(PIN_TAG):
            continue
        pin = line[len(PIN_TAG):].strip()
        if "==" not in pin:
            if canonical(pin) not in pinned:
                raise StageError(f"constraints.txt: `{line}` names no version and nothing pins {pin}")
            pin = pinned[canonical(pin)]
        pins.append(pin)
    if not pins:
        raise StageError(f"constraints.txt has no `{PIN_TAG.strip()} <pin>` lines")
    return pins


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(MIB):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class Manifest:
    """A chunk's MANIFEST: the archive, its sha256, and every part with its own sha256 (in order)."""

    archive: str
    sha256: str
    parts: dict[str, str]

    def text(self) -> str:
        lines = [f"archive {self.archive}", f"sha256 {self.sha256}", f"parts {len(self.parts)}"]
        return "\n".join(lines + [f"part {name} {digest}" for name, digest in self.parts.items()]) + "\n"

    @classmethod
    def read(cls, chunk: Path) -> Manifest:
        path = chunk / "MANIFEST"
        if not path.is_file():
            raise StageError(f"{chunk} is no chunk folder: it has no MANIFEST")
        fields: dict[str, str] = {}
        parts: dict[str, str] = {}
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "part":
                name, _, digest = value.partition(" ")
                parts[name] = digest
            else:
                fields[key] = value
        if "archive" not in fields or "sha256" not in fields or len(parts) != int(fields.get("parts", -1)):
            raise StageError(f"{path} is incomplete: pack the chunks again")
        return cls(fields["archive"], fields["sha256"], parts)


def pack(out: Path, chunk_mib: int | None, constraints: Path, tree: Path) -> list[Path]:
    pins = stage_pins(constraints.read_text())
    tree_mib = tree_size(tree) / MIB
    chunk_mib = chunk_mib or int(CARRY_TARGET_MIB - tree_mib)
    print(f"working tree {tree_mib:.1f} MiB + chunk {chunk_mib} MiB per call (limit {CARRY_LIMIT_MIB} MiB)")
    if chunk_mib + tree_mib + 1 > CARRY_LIMIT_MIB:
        print(f"warning: a chunk of {chunk_mib} MiB plus the tree exceeds what one call carries; use a smaller "
              f"--chunk-mib (at most {int(CARRY_LIMIT_MIB - 1 - tree_mib)})", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="stage-gpu-") as work:
        wheels, site = Path(work, "wheels"), Path(work, "site")
        platform = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
        print(f"downloading {len(pins)} wheels for cp312 manylinux x86_64")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                        "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", *platform,
                        "-d", str(wheels), *pins], check=True)
        for wheel in sorted(wheels.glob("*.whl")):
            unzip_wheel(wheel, site)
        leave_out(site)
        archive = Path(work, f"gpu-site-{time.strftime('%Y%m%d%H%M%S')}.tar.xz")
        print(f"packing {sum(f.stat().st_size for f in site.rglob('*') if f.is_file()) / MIB:.0f} MiB of site tree")
        with archive.open("wb") as packed:
            tar = subprocess.Popen(["tar", "-C", str(site), "-cf", "-", "."], stdout=subprocess.PIPE)
            subprocess.run(["xz", "-6", "-T0"], stdin=tar.stdout, stdout=packed, check=True)
            if tar.wait() != 0:
                raise StageError("tar failed")
        chunks = split(archive, out, chunk_mib * MIB)
    for chunk in chunks:
        size = sum(f.stat().st_size for f in chunk.iterdir()) / MIB
        print(f"  {chunk}: {size:.1f} MiB; there: python3 {chunk}/stage_gpu.py install {chunk} PREFIX")
    return chunks


def tree_size(tree: Path) -> int:
    """The bytes of the working tree one call carries: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "-C", str(tree), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode()
    return sum(path.stat().st_size for name in listed.split("\0") if name and (path := tree / name).is_file())


def unzip_wheel(wheel: Path, site: Path) -> None:
    """Unzip a wheel into the site tree as an install would lay it out (its .data purelib/platlib merged)."""
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            parts = member.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue  # scripts and headers: console scripts are made at install from entry_points.txt
                parts = parts[2:]
            if "__pycache__" in parts or member.is_dir():
                continue
            target = site.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as source, target.open("wb") as copy:
                shutil.copyfileobj(source, copy)
            if member.external_attr >> 16 & 0o111:
                target.chmod(0o755)


def leave_out(site: Path) -> None:
    for pattern in LEFT_OUT:
        for path in site.glob(pattern):
            print(f"leaving out {path.relative_to(site)}")
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
    for library in (site / "vllm" / "third_party").rglob("_C.cpython-3*.so"):
        if not library.name.startswith("_C.cpython-312-"):
            library.unlink()


def split(archive: Path, out: Path, part_bytes: int) -> list[Path]:
    """OUTDIR/c1, c2, ...: one part of the archive each, the MANIFEST and a copy of this tool."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("c[0-9]*"):
        shutil.rmtree(old)
    name = archive.name.removesuffix(".tar.xz")
    parts: dict[str, str] = {}
    chunks = []
    with archive.open("rb") as whole:
        while block := whole.read(part_bytes):
            chunk = out / f"c{len(chunks) + 1}"
            chunk.mkdir()
            part = chunk / f"{name}.part.{len(chunks):03d}"
            part.write_bytes(block)
            parts[part.name] = hashlib.sha256(block).hexdigest()
            chunks.append(chunk)
    manifest = Manifest(name, sha256(archive), parts)
    for chunk in chunks:
        (chunk / "MANIFEST").write_text(manifest.text())
        shutil.copy2(Path(__file__), chunk / "stage_gpu.py")
    return chunks


def receive(chunk: Path, prefix: Path) -> Path | None:
    """Keep the chunk's part under PREFIX/parts; once every part is there, extract PREFIX/site. The site, or None."""
    manifest = Manifest.read(chunk)
    site, parts = prefix / "site", prefix / "parts"
    done = parts / f"{manifest.archive}.done"
    if done.exists():
        print(f"{manifest.archive}: already extracted into {site}")
        return site
    parts.mkdir(parents=True, exist_ok=True)
    mine = [name for name in manifest.parts if (chunk / name).is_file()]
    if not mine:
        raise StageError(f"{chunk} holds none of the parts its MANIFEST names: copy the chunk folder whole")
    for name in mine:
        if sha256(chunk / name) != manifest.parts[name]:
            raise StageError(f"{chunk / name} is corrupt (sha256 differs from its MANIFEST): carry it again")
        shutil.copyfile(chunk / name, parts / name)
    present = [name for name in manifest.parts if (parts / name).is_file()]
    print(f"{manifest.archive}: {len(present)} of {len(manifest.parts)} parts present")
    if len(present) < len(manifest.parts):
        return None
    started = time.monotonic()
    archive = parts / f"{manifest.archive}.tar.xz"
    with archive.open("wb") as whole:
        for name in manifest.parts:
            with (parts / name).open("rb") as part:
                shutil.copyfileobj(part, whole)
    if sha256(archive) != manifest.sha256:
        archive.unlink()
        raise StageError(f"{manifest.archive}: the joined parts do not match the MANIFEST's sha256: pack again")
    if site.exists():
        shutil.rmtree(site)
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(site, filter="data")
    for name in manifest.parts:
        (parts / name).unlink()
    archive.unlink()
    done.touch()
    print(f"{manifest.archive}: extracted into {site} in {time.monotonic() - started:.0f} s")
    return site


def make_venv(prefix: Path, site: Path) -> Path:
    """PREFIX/venv over the host's packages, with the site tree ahead of them (a .pth file: no PYTHONPATH)."""
    venv = prefix / "venv"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                       check=True)
    # The host's python may itself be a venv (its torch outside the base interpreter's site-packages): every
    # site-packages folder this python sees comes after the site tree, with their own .pth files processed.
    host = [entry for entry in sys.path if Path(entry).name in ("site-packages", "dist-packages")]
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    dirs = ", ".join(repr(str(path)) for path in [site, *host])
    Path(purelib, "lorafleet-gpu-stage.pth").write_text(f"import site; [site.addsitedir(d) for d in ({dirs},)]\n")
    write_scripts(site, python)
    print(f"venv {venv}: {site} and the host's packages ({', '.join(host)}) on its path")
    return python


def write_scripts(site: Path, python: Path) -> None:
    """Console scripts of the site tree's packages (`vllm`, ...) next to the venv's python, as pip would make them:
    behind a `__main__` guard, since vLLM's engine core is a spawned process that imports the script again (without
    the guard it runs `main()` a second time and the engine fails to start)."""
    for entry_points in site.glob("*.dist-info/entry_points.txt"):
        parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
        parser.optionxform = str  # type: ignore[assignment,method-assign]
        parser.read(entry_points)
        if not parser.has_section("console_scripts"):
            continue
        for name, target in parser.items("console_scripts"):
            module, _, attribute = target.strip().partition(":")
            script = python.parent / name
            script.write_text(f"#!{python}\nimport sys\nfrom {module} import {attribute.split('.')[0]}\n"
                              f"if __name__ == \"__main__\":\n    sys.exit({attribute.strip()}())\n")
            script.chmod(0o755)


def install_tree(python: Path, tree: Path) -> None:
    missing = [package for package in TREE_PACKAGES if not (tree / package / "pyproject.toml").is_file()]
    if missing:
        raise StageError(f"{tree.resolve()} is not the lorafleet checkout (no {', '.join(missing)}): run from its root")
    editable = [arg for package in TREE_PACKAGES for arg in ("-e", str((tree / package).resolve()))]
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--no-build-isolation", "--no-index", *editable], check=True)
    print(f"lorafleet packages installed editable from {tree.resolve()}")


CHECK = """
import importlib, importlib.metadata as md, json, re, sys
failed = {}
for module in sys.argv[1].split(","):
    try:
        importlib.import_module(module)
    except BaseException as exc:
        failed[module] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
unmet = []
roots = sys.argv[2].split(",") if sys.argv[2] else [sys.prefix]
try:
    from packaging.requirements import Requirement
    installed = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower(): d.version for d in md.distributions()}
    for dist in md.distributions():
        if not str(dist.locate_file("")).startswith(tuple(roots)):
            continue
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker and not req.marker.evaluate({"extra": ""}):
                continue
            have = installed.get(re.sub(r"[-_.]+", "-", req.name).lower())
            if have is None or not req.specifier.contains(have, prereleases=True):
                unmet.append(f"{dist.metadata['Name']} needs {text}: {'absent' if have is None else have}")
except ImportError as exc:
    unmet.append(f"not checked: {exc}")
print(json.dumps({"failed": failed, "unmet": sorted(set(unmet))}))
"""


def check(python: Path, under: Path | None = None) -> bool:
    """Import every module the GPU tier needs in one process of `python`; report every failure at once.

    Then the requirements that nothing installed meets, of the packages installed under `under` (default: the
    python's own prefix): warnings, as vLLM names libraries left out on purpose.
    """
    result = subprocess.run([str(python), "-c", CHECK, ",".join(MODULES), str(under or "")], capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise StageError(f"{python} could not run the import check: {result.stderr.strip()}")
    report = json.loads(result.stdout.splitlines()[-1])
    scripts = [name for name in SCRIPTS if not (python.parent / name).exists()]
    for line in report["unmet"]:
        print(f"  requirement not met (warning): {line}")
    for module, error in report["failed"].items():
        print(f"  missing: {module} ({error})")
    for name in scripts:
        print(f"  missing: console script {python.parent / name}")
    ok = not report["failed"] and not scripts
    print(f"check: {len(MODULES) - len(report['failed'])} of {len(MODULES)} modules import with {python}"
          + ("" if ok else f"; {len(report['failed'])} fail, {len(scripts)} console scripts missing"))
    return ok


def install(chunk: Path, prefix: Path, tree: Path) -> int:
    prefix = prefix.absolute()
    site = receive(chunk, prefix)
    if site is None:
        print("install the other chunks (any order) to complete")
        return 0
    python = make_venv(prefix, site)
    install_tree(python, tree)
    if not check(python, prefix):
        return 1
    print(f"GPU_PYTHON={python}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stage_gpu.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack", help="download, pack and split into OUTDIR/c1, c2, ... (here)")
    packing.add_argument("out", type=Path, metavar="OUTDIR")
    packing.add_argument("--chunk-mib", type=int, help=f"part size (default: {CARRY_TARGET_MIB} MiB less the tree)")
    packing.add_argument("--constraints", type=Path, default=Path("constraints.txt"))
    installing = commands.add_parser("install", help="receive one chunk; once all are in, make PREFIX/venv (there)")
    installing.add_argument("chunk", type=Path, metavar="CHUNKDIR")
    installing.add_argument("prefix", type=Path, metavar="PREFIX")
    installing.add_argument("--tree", type=Path, default=Path("."), help="the checkout's root (default: .)")
    checking = commands.add_parser("check", help="import every module the GPU tier needs; list all that fail")
    checking.add_argument("--python", type=Path, default=Path(sys.executable))
    checking.add_argument("--under", type=Path, help="requirements of the packages under DIR (default: its prefix)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "pack":
            pack(args.out, args.chunk_mib, args.constraints, Path("."))
            return 0
        if args.command == "install":
            return install(args.chunk, args.prefix, args.tree)
        return 0 if check(args.python, args.under) else 1
    except StageError as exc:
        print(f"stage_gpu.py: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
