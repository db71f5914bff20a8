"""The wheelhouse scripts/gpu_check.sh carries to a GPU machine that has no package index: the packages tp_train
needs (pyproject.toml's dependencies and test tools, and theirs, transitively) that the machine's image lacks
(scripts/gpu_image_packages.txt), as wheels for its Python 3.12 on manylinux x86_64, at constraints.txt's versions.

    python scripts/gpu_wheels.py download wheelhouse   # make gpu-wheels: pip download, here, with an index
    python scripts/gpu_wheels.py check wheelhouse      # complete? (also every import in the tree resolves)
    python scripts/gpu_wheels.py install wheelhouse    # there: pip install --no-index --no-deps what is missing,
                                                       # tp_train from the tree, then import what the tree imports

One walk serves all three: from pyproject's requirements, a name the image has is taken as there (its own needs
with it); any other must be a wheel here, whose METADATA names the next ones. `download` fetches what the walk
finds missing until nothing is; `check` fails naming what is missing, extra, of another version or platform.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
IMAGE_LIST = ROOT / "scripts" / "gpu_image_packages.txt"
MAX_MIB = 60  # the tree travels with it, 64 MiB in all
NOT_CARRIED = {"ruff"}  # dev tools the GPU check never runs (linting happens here)
# The GPU machine: CPython 3.12 on manylinux x86_64 (Ubuntu 24.04's glibc 2.39).
MARKERS = {
    **default_environment(),
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
PLATFORMS = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"] + [
    f"manylinux_2_{minor}_x86_64" for minor in range(5, 40)
]
DOWNLOAD_PLATFORMS = ["manylinux2014_x86_64", "manylinux1_x86_64"] + [
    f"manylinux_2_{minor}_x86_64" for minor in (17, 24, 27, 28, 31, 34, 35)
]
TAGS = set(cpython_tags((3, 12), platforms=PLATFORMS)) | set(compatible_tags((3, 12), "cp312", PLATFORMS))
LOCAL_MODULES = {"tp_train", "models", "train", "tests", "__main__"}


def image_packages() -> set[str]:
    lines = IMAGE_LIST.read_text().splitlines()
    return {canonicalize_name(line.strip()) for line in lines if line.strip() and not line.startswith("#")}


def pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            out[canonicalize_name(name)] = version.strip()
    return out


def roots() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    return [r for r in requirements if canonicalize_name(r.name) not in NOT_CARRIED]


def wheels(wheelhouse: Path) -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for path in sorted(wheelhouse.glob("*.whl")):
        out.setdefault(canonicalize_name(parse_wheel_filename(path.name)[0]), []).append(path)
    return out


def wheel_requirements(path: Path, extras: set[str]) -> list[Requirement]:
    """What the wheel needs on the GPU machine (with `extras`), from its METADATA's Requires-Dist."""
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        metadata = Parser().parsestr(archive.read(name).decode())
    out = []
    for line in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        wanted = requirement.marker is None or any(
            requirement.marker.evaluate({**MARKERS, "extra": extra}) for extra in extras | {""}
        )
        if wanted:
            out.append(requirement)
    return out


def walk(wheelhouse: Path, image: set[str]) -> tuple[dict[str, str], dict[str, str]]:
    """({name: where it comes from} for every distribution reached, {missing name: who needs it})."""
    found = wheels(wheelhouse)
    reached: dict[str, str] = {}
    missing: dict[str, str] = {}
    queue = [(requirement, "pyproject.toml") for requirement in roots()]
    seen_extras: dict[str, set[str]] = {}
    while queue:
        requirement, needed_by = queue.pop()
        name = canonicalize_name(requirement.name)
        extras = set(requirement.extras)
        if name in reached and extras <= seen_extras.get(name, set()):
            continue
        seen_extras.setdefault(name, set()).update(extras)
        if name in image:
            reached[name] = "image"
        elif name in found:
            reached[name] = found[name][0].name
            queue += [(r, name) for r in wheel_requirements(found[name][0], seen_extras[name])]
        else:
            missing.setdefault(name, needed_by)
    return reached, missing


def imported_modules() -> list[tuple[str, str]]:
    """(top-level module, importing file) for every third-party import in tp_train, models, train.py and tests."""
    files = [*(ROOT / "tp_train").rglob("*.py"), *(ROOT / "models").rglob("*.py"), ROOT / "train.py"]
    files += [*(ROOT / "tests").rglob("*.py")]
    out = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top in LOCAL_MODULES or (ROOT / "tests" / f"{top}.py").exists():
                    continue
                out.append((top, str(path.relative_to(ROOT))))
    return out


def imported_distributions() -> dict[str, str]:
    """{distribution: a file importing it}, the modules mapped to distributions by this environment's packages."""
    by_module = importlib.metadata.packages_distributions()
    out = {}
    for module, importer in imported_modules():
        for distribution in by_module.get(module, [module]):
            out.setdefault(canonicalize_name(distribution), importer)
    return out


def problems(wheelhouse: Path) -> list[str]:
    """What makes the wheelhouse incomplete or wrong for the GPU machine; empty when it is right."""
    if not wheelhouse.is_dir():
        return [f"{wheelhouse}: no such folder; build it with `make gpu-wheels`"]
    image, pinned, found = image_packages(), pins(), wheels(wheelhouse)
    reached, missing = walk(wheelhouse, image)
    out = [f"{name}: needed by {needer}, neither in the image nor in {wheelhouse}" for name, needer in missing.items()]
    for distribution, importer in imported_distributions().items():
        if distribution not in reached and distribution not in image:
            out.append(f"{distribution}: imported by {importer}, neither in the image nor in {wheelhouse}")
    for name, paths in found.items():
        if len(paths) > 1:
            out.append(f"{name}: {len(paths)} wheels ({', '.join(p.name for p in paths)}); keep one")
        version = str(parse_wheel_filename(paths[0].name)[1])
        if name in image:
            out.append(f"{paths[0].name}: the image has {name}; carrying it would replace the image's")
        elif name not in reached:
            out.append(f"{paths[0].name}: nothing tp_train needs requires it")
        if pinned.get(name) != version:
            out.append(f"{paths[0].name}: version {version}, constraints.txt pins {pinned.get(name)}")
        if not set(parse_wheel_filename(paths[0].name)[3]) & TAGS:
            out.append(f"{paths[0].name}: not installable on CPython 3.12 / manylinux x86_64")
    size = sum(path.stat().st_size for path in wheelhouse.glob("*")) / 2**20
    if size > MAX_MIB:
        out.append(f"{wheelhouse}: {size:.1f} MiB, over the {MAX_MIB} MiB that may travel with the tree")
    return out


def download(wheelhouse: Path) -> None:
    """Fetches, one by one, each wheel the walk finds missing, at constraints.txt's version; a name published only
    as a source archive is built into a wheel here (it must come out pure Python)."""
    wheelhouse.mkdir(exist_ok=True)
    image, pinned = image_packages(), pins()
    while True:
        _, missing = walk(wheelhouse, image)
        if not missing:
            break
        for name, needer in missing.items():
            if name not in pinned:
                sys.exit(f"error: {name} (needed by {needer}) has no version in constraints.txt; pin it there")
            spec = f"{name}=={pinned[name]}"
            platforms = [flag for platform in DOWNLOAD_PLATFORMS for flag in ("--platform", platform)]
            fetched = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                 "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(wheelhouse), spec],
            )  # fmt: skip
            if fetched.returncode != 0:
                print(f"gpu-wheels: {spec} has no wheel for CPython 3.12; building one from its source archive")
                subprocess.run(
                    [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheelhouse), spec],
                    check=True,
                )


def install(wheelhouse: Path) -> bool:
    """Installs the wheels whose distribution this environment lacks, without resolving (--no-deps: torch and
    everything the image holds stay as they are) and without an index; then tp_train from this tree, editable,
    built by the environment's own setuptools. True when both went in."""
    wanted, kept = [], []
    for name, paths in wheels(wheelhouse).items():
        try:
            kept.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            wanted.append(str(paths[0]))
    if kept:
        print(f"gpu-wheels: already installed, kept: {', '.join(kept)}")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--disable-pip-version-check"]
    if wanted and subprocess.run([*pip, "--no-cache-dir", "--find-links", str(wheelhouse), *wanted]).returncode:
        print(f"gpu-wheels: pip could not install the wheels of {wheelhouse}")
        return False
    print(f"gpu-wheels: installed {len(wanted)} wheels from {wheelhouse}")
    if subprocess.run([*pip, "--no-build-isolation", "-e", str(ROOT)]).returncode:
        print(
            "gpu-wheels: pip could not install tp_train from the tree (no console scripts); PYTHONPATH still finds it"
        )
        return False
    print(f"gpu-wheels: installed tp_train from {ROOT} (editable)")
    return True


def imports() -> bool:
    """Imports every third-party module the tree imports, and the tree's own entry points; prints each failure."""
    wanted = {canonicalize_name(requirement.name) for requirement in roots()}
    provided = importlib.metadata.packages_distributions().items()
    by_requirement = {m for m, names in provided for n in names if canonicalize_name(n) in wanted and m[0] != "_"}
    modules = sorted({module for module, _ in imported_modules()} | by_requirement)  # wandb: through Lightning
    modules += ["tp_train", "models", "train", "tp_train.app.generate"]
    sys.path.insert(0, str(ROOT))  # `train` (train.py) is no package
    failed = []
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 - every failure is reported, not only the first
            failed.append(module)
            print(f"gpu-wheels: import {module} failed: {type(error).__name__}: {error}")
    print(f"gpu-wheels: {len(modules) - len(failed)} of {len(modules)} modules import ({', '.join(modules)})")
    return not failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["download", "check", "install", "imports"])
    parser.add_argument("wheelhouse", type=Path, nargs="?", default=ROOT / "wheelhouse")
    args = parser.parse_args()
    if args.command == "download":
        download(args.wheelhouse)
    if args.command == "install":
        installed = install(args.wheelhouse)
        sys.exit(0 if imports() and installed else 1)
    if args.command == "imports":
        sys.exit(0 if imports() else 1)
    found = problems(args.wheelhouse)
    for problem in found:
        print(f"wheelhouse: {problem}", file=sys.stderr)
    if found:
        sys.exit(1)
    count = len(list(args.wheelhouse.glob("*.whl")))
    size = sum(path.stat().st_size for path in args.wheelhouse.glob("*")) / 2**20
    print(f"wheelhouse complete: {count} wheels, {size:.1f} MiB; tp_train's needs and imports resolve from the image")


if __name__ == "__main__":
    main()
