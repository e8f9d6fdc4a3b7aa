"""The demo model's corpus: the King James Bible from Debian's bible-kjv packages.

Debian ships the text compressed in the `bible` tool's own format (bible.data), so the
packages are downloaded (apt-get download, no root) and unpacked into a cache, and the
packaged tool itself decodes the whole text. The KJV text is public domain (1611); the
packages' own copyright file says so.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

PACKAGES = ("bible-kjv", "bible-kjv-text")  # the tool (amd64) and its data (all)
VERSION = "4.38"  # Debian bookworm's; the one the shipped model was trained on
_VERSE = re.compile(r"^\s+\d+ (.+)$")


def fetch_debs(cache: Path) -> list[Path]:
    """The two .deb files, downloaded once into ``cache``."""
    cache.mkdir(parents=True, exist_ok=True)
    debs = [next(cache.glob(f"{name}_{VERSION}_*.deb"), None) for name in PACKAGES]
    if None in debs:
        subprocess.run(["apt-get", "download", *(f"{n}={VERSION}" for n in PACKAGES)], cwd=cache, check=True)
        debs = [next(cache.glob(f"{name}_{VERSION}_*.deb")) for name in PACKAGES]
    return debs


def kjv_verses(cache: Path) -> list[str]:
    """Every verse, Genesis 1:1 to Revelation 22:21, one string each, in order."""
    root = cache / "unpacked"
    for deb in fetch_debs(cache):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    # -l: a line width wider than any verse, so each verse comes out on one line.
    out = subprocess.run([str(root / "usr/bin/bible"), "-p", f"{root}/usr/lib/", "-m", "8192",
                          "-l", "100000", "gen1:1-rev22:21"], check=True, capture_output=True, text=True).stdout
    verses = [m.group(1).strip() for line in out.splitlines() if (m := _VERSE.match(line))]
    if len(verses) != 31102:  # the KJV's verse count: anything else means a bad decode
        raise RuntimeError(f"decoded {len(verses)} verses from {PACKAGES}, expected 31102")
    return verses
