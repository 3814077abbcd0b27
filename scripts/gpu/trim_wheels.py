"""Trim big wheels for a size-limited carry: keep the Python files, the given
ELF roots and the closure of their DT_NEEDED among the wheel's own libraries;
drop everything else; rewrite RECORD (hashes of kept files); recompress (deflate 9).

usage: python trim_wheels.py IN.whl OUT_DIR ROOT_REGEX [ROOT_REGEX ...]
"""

import base64
import csv
import hashlib
import io
import os
import re
import subprocess
import sys
import tempfile
import zipfile

src, outdir, *roots = sys.argv[1:]
zin = zipfile.ZipFile(src)
names = [n for n in zin.namelist() if not n.endswith("/")]
by_base = {}
for n in names:
    by_base.setdefault(os.path.basename(n), []).append(n)


def is_elf(data: bytes) -> bool:
    return data[:4] == b"\x7fELF"


def needed(name: str) -> list[str]:
    data = zin.read(name)
    if not is_elf(data):
        return []
    with tempfile.NamedTemporaryFile() as f:
        f.write(data)
        f.flush()
        out = subprocess.run(["readelf", "-d", f.name], capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)


keep = set()
for n in names:
    if (
        n.endswith(".py")
        or n.endswith(".pyi")
        or n.endswith("py.typed")
        or ".dist-info/" in n
        or any(re.search(r, n) for r in roots)
    ):
        keep.add(n)
todo = [n for n in keep]
while todo:
    n = todo.pop()
    for lib in needed(n):
        for cand in by_base.get(lib, []):
            if cand not in keep:
                keep.add(cand)
                todo.append(cand)
record = next(n for n in names if n.endswith(".dist-info/RECORD"))
os.makedirs(outdir, exist_ok=True)
dst = os.path.join(outdir, os.path.basename(src))
rows = []
with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for n in names:
        if n not in keep or n == record:
            continue
        data = zin.read(n)
        info = zin.getinfo(n)
        zi = zipfile.ZipInfo(n, date_time=info.date_time)
        zi.external_attr = info.external_attr
        zi.compress_type = zipfile.ZIP_DEFLATED
        zout.writestr(zi, data, compresslevel=9)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append((n, f"sha256={digest}", str(len(data))))
    rows.append((record, "", ""))
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    zout.writestr(record, buf.getvalue())
dropped = sorted(set(names) - keep)
print(
    f"{dst}: kept {len(keep)} of {len(names)} files, {os.path.getsize(dst) / 2**20:.1f} MiB "
    f"(was {os.path.getsize(src) / 2**20:.1f} MiB)"
)
for n in sorted(keep):
    if zin.getinfo(n).file_size > 200_000:
        print("  keep", n, zin.getinfo(n).file_size)
