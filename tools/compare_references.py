"""Compare two directories of references dataset by dataset, bit for bit (issue 30's "every reference reproduced
after the move"):

    python tools/compare_references.py OLD_DIR NEW_DIR [TASK ...]

Every dataset's dtype, shape and bytes, and every attribute except those that say when, where and how fast it was
recorded (VOLATILE) and the provenance hashes (which change with file moves by design: `make stale` says which).
Prints each difference; last line IDENTICAL (N references, M datasets) or N DIFFERENCES."""
import sys
from pathlib import Path

import h5py
import numpy as np

from catalog.h5schema import link_names

VOLATILE = {"created", "wall_clock_s", "seconds", "peak_rss_bytes", "rss_at_start_bytes", "source_sha256",
            "config_sha256", "package_versions"}


def _attrs(obj) -> dict:
    return {k: v for k, v in obj.attrs.items() if k not in VOLATILE}


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == object or b.dtype == object:  # variable-length strings: compare the values, not the pointers
        return a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist()
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def compare(old: Path, new: Path) -> tuple[list[str], int]:
    out, count = [], 0
    with h5py.File(old, "r") as f, h5py.File(new, "r") as g:
        items, names_new = set(link_names(f)), set(link_names(g))  # by link: a shared array counts at each name
        for n in sorted(set(items) ^ names_new):
            out.append(f"{old.stem} {n}: only in {'old' if n in items else 'new'}")
        for n in sorted(set(items) & names_new):
            a, b = f[n], g[n]
            for k in sorted(set(_attrs(a)) | set(_attrs(b))):
                if k not in a.attrs or k not in b.attrs or not _same(a.attrs[k], b.attrs[k]):
                    out.append(f"{old.stem} {n}: attribute {k} differs")
            if isinstance(a, h5py.Dataset):
                count += 1
                if not _same(a[()], b[()]):
                    out.append(f"{old.stem} {n}: data differs")
        for k in sorted(set(_attrs(f)) | set(_attrs(g))):
            if k not in f.attrs or k not in g.attrs or not _same(f.attrs[k], g.attrs[k]):
                out.append(f"{old.stem}: file attribute {k} differs")
    return out, count


def main(argv: list[str]) -> int:
    old_dir, new_dir, tasks = Path(argv[0]), Path(argv[1]), argv[2:]
    tasks = tasks or sorted(p.stem for p in old_dir.glob("*.h5"))
    bad, total = [], 0
    for t in tasks:
        if not (new_dir / f"{t}.h5").is_file():
            bad.append(f"{t}: no new reference")
            continue
        diffs, n = compare(old_dir / f"{t}.h5", new_dir / f"{t}.h5")
        bad += diffs
        total += n
    print("\n".join(bad))
    print(f"IDENTICAL ({len(tasks)} references, {total} datasets)" if not bad else f"{len(bad)} DIFFERENCES")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
