"""Build linnos_block.bpf.o from its source, and check the shipped object against it.

    python -m gpuos_tools.kinfer.bpf.build            # rebuild the shipped object in place
    python -m gpuos_tools.kinfer.bpf.build --check    # rebuild in a temporary folder and compare

The build is clang (``-target bpfel``, BTF from ``-g``) then ``bpftool gen object``, libbpf's
static linker, which keeps the program, map and BTF sections and drops the DWARF. The source
is compiled from its own folder, by its bare name, with ``-fdebug-prefix-map`` mapping that
folder to ``.``: the BTF line information then names ``./linnos_block.bpf.c`` wherever the
checkout lives, and two builds with the same clang and bpftool are byte-identical.

``linnos_block.bpf.json`` records the tools that built the shipped object and its digest.
With the same clang major version the check asks for identical bytes; with another one
(whose code generation may differ) it compares what the object is made of instead
(``describe``: each program's section and symbol, the maps with their types and sizes, the
license, the BTF's named types) and says that it did.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from gpuos_tools.kinfer.bpf import HEADER, HERE, OBJECT, SOURCE

MANIFEST = HERE / "linnos_block.bpf.json"
FLAGS = ["-g", "-O2", "-target", "bpfel", "-mcpu=v3", "-Wall", "-Werror"]


class BuildError(RuntimeError):
    """clang or bpftool missing or failing; the message says which and why."""


def tools() -> dict[str, str]:
    """The clang and bpftool on PATH (BuildError when one is missing)."""
    found = {name: shutil.which(name) for name in ("clang", "bpftool")}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise BuildError(f"{' and '.join(missing)} not on PATH (Debian: apt-get install clang bpftool libbpf-dev)")
    return {name: str(path) for name, path in found.items()}


def tool_versions(found: dict[str, str] | None = None) -> dict[str, str]:
    found = found or tools()
    clang = subprocess.run([found["clang"], "--version"], capture_output=True, text=True).stdout.splitlines()
    bpftool = subprocess.run([found["bpftool"], "version"], capture_output=True, text=True).stdout.splitlines()
    # bpftool's first line starts with the path it was run by: keep the name and the version
    bpftool_version = " ".join(["bpftool", *bpftool[0].split()[1:]]) if bpftool else "?"
    return {"clang": clang[0].strip() if clang else "?", "bpftool": bpftool_version}


def _major(version: str) -> str | None:
    m = re.search(r"clang version (\d+)", version)
    return m.group(1) if m else None


def build(out: Path, source: Path = SOURCE) -> Path:
    """Compile ``source`` (with its header beside it) into ``out``; return ``out``."""
    found = tools()
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    includes = [f"-I/usr/include/{multiarch}"] if multiarch else []  # asm/types.h for linux/types.h
    folder = source.resolve().parent
    with tempfile.TemporaryDirectory(prefix="gpuos-bpf-") as tmp:
        raw = Path(tmp) / "raw.o"
        cmd = [found["clang"], *FLAGS, *includes, f"-fdebug-prefix-map={folder}=.", "-c", source.name, "-o", str(raw)]
        done = subprocess.run(cmd, cwd=folder, capture_output=True, text=True)
        if done.returncode != 0:
            raise BuildError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        staged = Path(tmp) / "linked.o"
        link = [found["bpftool"], "gen", "object", str(staged), str(raw)]
        done = subprocess.run(link, capture_output=True, text=True)
        if done.returncode != 0:
            raise BuildError(f"{' '.join(link)} failed:\n{done.stderr.strip()}")
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(staged, out)
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def inputs_digest() -> str:
    """Digest of what the object is built from (source and header)."""
    h = hashlib.sha256()
    for path in (SOURCE, HEADER):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def describe(path: Path) -> dict[str, Any]:
    """What an object is made of, independent of the compiler's exact code: program sections
    and symbols, maps (type, key and value sizes, entries, from BTF), license, named BTF types."""
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        elf = ELFFile(f)
        sections = [s.name for s in elf.iter_sections()]
        symtab = elf.get_section_by_name(".symtab")
        by_index = {i: s.name for i, s in enumerate(elf.iter_sections())}
        programs: list[tuple[str, str]] = []
        maps: list[str] = []
        for sym in symtab.iter_symbols() if symtab is not None else []:
            sec = by_index.get(sym["st_shndx"]) if isinstance(sym["st_shndx"], int) else None
            if sym["st_info"]["type"] == "STT_FUNC" and sym["st_info"]["bind"] == "STB_GLOBAL" and sec:
                programs.append((sec, sym.name))
            elif sec == ".maps":
                maps.append(sym.name)
        lic = elf.get_section_by_name("license")
        license_text = lic.data().rstrip(b"\0").decode() if lic is not None else None
    found = tools()
    dump = subprocess.run([found["bpftool"], "btf", "dump", "file", str(path)], capture_output=True, text=True)
    if dump.returncode != 0:
        raise BuildError(f"bpftool btf dump {path}: {dump.stderr.strip()}")
    # named types with their kind, size and members' names (not ids, which depend on order)
    types = sorted({re.sub(r"\[\d+\] ", "", line).split(" type_id=")[0] for line in dump.stdout.splitlines()
                    if line.startswith("[") and "'(anon)'" not in line})
    return {"sections": sorted(sections), "programs": sorted(programs), "maps": sorted(maps), "license": license_text,
            "btf_types": types}


def check(workdir: Path | None = None) -> tuple[bool, str]:
    """Rebuild into a temporary folder and compare with the shipped object: (ok, what was compared)."""
    manifest = json.loads(MANIFEST.read_text())
    if manifest.get("inputs_sha256") != inputs_digest():
        return False, f"{SOURCE.name} or {HEADER.name} changed since the shipped object was built: rebuild it"
    with tempfile.TemporaryDirectory(prefix="gpuos-bpf-check-", dir=workdir) as tmp:
        fresh = build(Path(tmp) / OBJECT.name)
        versions = tool_versions()
        if sha256(fresh) == sha256(OBJECT):
            return True, f"byte-identical rebuild ({versions['clang']}, {versions['bpftool']})"
        same_clang = _major(versions["clang"]) == _major(manifest.get("clang", ""))
        if same_clang:
            return False, (f"the rebuild differs from the shipped object with the same clang major version "
                           f"({versions['clang']}; shipped: {manifest.get('clang')}): rebuild and commit it")
        a, b = describe(fresh), describe(OBJECT)
        if a == b:
            return True, (f"same programs, maps, license and BTF types (clang {versions['clang']} here, "
                          f"{manifest.get('clang')} built the shipped object: bytes are not comparable)")
        diff = [key for key in a if a[key] != b[key]]
        return False, f"the rebuild differs from the shipped object in {', '.join(diff)}"


def write_shipped() -> dict[str, Any]:
    """Rebuild the shipped object and its manifest."""
    build(OBJECT)
    manifest = {**tool_versions(), "object_sha256": sha256(OBJECT), "inputs_sha256": inputs_digest(),
                "flags": FLAGS}
    MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpuos_tools.kinfer.bpf.build", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="rebuild in a temporary folder and compare with the shipped object")
    args = ap.parse_args(argv)
    try:
        if args.check:
            ok, how = check()
            print(f"{OBJECT.name}: {'ok' if ok else 'MISMATCH'}: {how}", file=sys.stderr)
            return 0 if ok else 1
        manifest = write_shipped()
    except BuildError as e:
        print(f"build: {e}", file=sys.stderr)
        return 2
    print(f"{OBJECT}: {manifest['object_sha256']} ({manifest['clang']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
