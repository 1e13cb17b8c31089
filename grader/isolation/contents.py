"""What a candidate tree may carry: Python sources and small text configs, nothing else.

The import checks (grader/isolation/gate.py) see what a candidate imports; this sees what it brings. A candidate
that carries torch itself (a copied package, a wheel, an archive, shared objects) and imports it under a
name spelled at run time, or carries a reference (an HDF5 or npz file, or one base64'd into a literal),
scores by what it brings instead of what it computes. So every file the grader would copy into the child
(the candidate packages and top-level modules, grader/isolation/gate.py's candidate_packages) is inspected:

- kinds: `.py`/`.pyi` sources and text configs (`.json .yaml .yml .toml .txt .md .cfg .ini`, `py.typed`);
  any other file is refused, whatever its name says;
- sizes: each file at most MAX_FILE_BYTES, the whole tree at most MAX_TREE_BYTES (the repo's own oracle
  tree is ~0.6 MB);
- contents: no NUL byte in a text file, and no file that opens as HDF5, zip (wheels, npz), gzip, bzip2,
  xz, ELF, numpy .npy or safetensors, whatever its extension;
- literals: no string or bytes literal over MAX_LITERAL_BYTES in a source (data, not code), and no long
  base64 or hex literal that decodes to one of the formats above;
- names: no directory named after a forbidden package (torch/, transformers/, ...) and no installed
  package metadata (`*.dist-info`, `*.egg-info`) anywhere in the tree.

What this cannot see: a reference hidden in many small literals, or computed from the candidate's own
code; the fresh-input pass of the twin harness is the answer to those (issue 36).
"""
from __future__ import annotations

import ast
import base64
import binascii
import os
import re
from pathlib import Path

from catalog import pysource
from grader.isolation.candidate import FORBIDDEN, candidate_packages  # the copy the child gets: gate._copy_candidate

__all__ = ["MAX_FILE_BYTES", "MAX_LITERAL_BYTES", "MAX_TREE_BYTES", "inspect_tree"]

MAX_FILE_BYTES = 1 << 20  # 1 MiB: the largest oracle source is ~40 kB
MAX_TREE_BYTES = 16 << 20  # 16 MiB over every file the child would get
MAX_LITERAL_BYTES = 64 << 10  # 64 KiB in one literal
SOURCE_SUFFIXES = frozenset({".py", ".pyi"})
CONFIG_SUFFIXES = frozenset({".json", ".yaml", ".yml", ".toml", ".txt", ".md", ".cfg", ".ini"})
ALLOWED_NAMES = frozenset({"py.typed"})
_MAGIC = ((b"\x89HDF\r\n\x1a\n", "HDF5"), (b"PK\x03\x04", "zip"), (b"PK\x05\x06", "zip"), (b"\x1f\x8b", "gzip"),
          (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"\x7fELF", "ELF"), (b"\x93NUMPY", "numpy .npy"),
          (b"\xcf\xfa\xed\xfe", "Mach-O"), (b"MZ", "PE"))
_B64 = re.compile(rb"^[A-Za-z0-9+/=\s]+$")
_HEX = re.compile(rb"^[0-9a-fA-F\s]+$")
_ENCODED_MIN = 4096  # shorter encoded strings are not worth decoding


def binary_kind(head: bytes) -> str | None:
    """The binary format `head` (a file's first bytes) opens as, or None."""
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    if len(head) >= 10 and head[8:10] == b'{"':  # safetensors: u64 header length, then a JSON header
        n = int.from_bytes(head[:8], "little")
        if 2 <= n < (1 << 28):
            return "safetensors"
    return None


def _decoded_kind(value: bytes) -> str | None:
    if len(value) < _ENCODED_MIN:
        return None
    sample = value[: 1 << 12]
    for pattern, decode in ((_HEX, binascii.unhexlify), (_B64, base64.b64decode)):
        if pattern.match(sample):
            try:
                head = decode(re.sub(rb"\s", b"", value[:4096])[:4096 // 4 * 4])
            except (binascii.Error, ValueError):
                continue
            if kind := binary_kind(head):
                return kind
    return None


def _literals(source: bytes, rel: str) -> list[str]:
    try:
        tree = pysource.parse(source, filename=rel)
    except (SyntaxError, ValueError):
        return []  # the static scan reports it unparseable
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
            raw = node.value.encode("utf-8", "surrogatepass") if isinstance(node.value, str) else node.value
            line = getattr(node, "lineno", 0)
            if len(raw) > MAX_LITERAL_BYTES:
                out.append(f"{rel}:{line}: a literal of {len(raw)} bytes (over {MAX_LITERAL_BYTES}): data, not code")
            elif kind := _decoded_kind(raw):
                out.append(f"{rel}:{line}: a literal that decodes to {kind} data")
    return out


def _files(root: Path) -> list[Path]:
    files = sorted(p for p in root.glob("*.py") if p.is_file() and not p.is_symlink())
    for package in candidate_packages(root):
        for dirpath, dirnames, filenames in os.walk(package):
            dirnames[:] = sorted(n for n in dirnames if n != "__pycache__")
            files += [Path(dirpath, f) for f in sorted(filenames)
                      if not f.endswith(".pyc") and not Path(dirpath, f).is_symlink()]
    return files


def _bad_directories(root: Path) -> list[str]:
    out = []
    for package in candidate_packages(root):
        for dirpath, dirnames, _ in os.walk(package):
            for d in sorted(dirnames):
                rel = Path(dirpath, d).relative_to(root).as_posix()
                if d in FORBIDDEN:
                    out.append(f"{rel}/: a directory named after the forbidden package {d!r}")
                elif d.endswith((".dist-info", ".egg-info")):
                    out.append(f"{rel}/: installed package metadata")
    return out


def inspect_tree(candidate_root: str | Path) -> list[str]:
    """Offences of the candidate's files (see the module doc), sorted; [] when it carries only what it may."""
    root = Path(candidate_root)
    offences, total = _bad_directories(root), 0
    for path in _files(root):
        rel = path.relative_to(root).as_posix()
        size = path.stat().st_size
        total += size
        if path.suffix not in SOURCE_SUFFIXES | CONFIG_SUFFIXES and path.name not in ALLOWED_NAMES:
            offences.append(f"{rel}: not a Python source or text config ({size} bytes)")
            continue
        if size > MAX_FILE_BYTES:
            offences.append(f"{rel}: {size} bytes, over the {MAX_FILE_BYTES} a source or config may have")
            continue
        data = path.read_bytes()
        if kind := binary_kind(data[:64]):
            offences.append(f"{rel}: {kind} data under a text name")
        elif b"\x00" in data:
            offences.append(f"{rel}: binary data (a NUL byte) under a text name")
        elif path.suffix in SOURCE_SUFFIXES:
            offences += _literals(data, rel)
    if total > MAX_TREE_BYTES:
        offences.append(f"the candidate's files come to {total} bytes, over the {MAX_TREE_BYTES} limit")
    return sorted(offences)
