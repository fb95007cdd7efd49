"""A PNG of a report page, rendered by headless Chromium (Debian package ``chromium``).

    python -m npuq.report.screenshot out/demo/report.html docs/report.png [--width 1100] [--height 2400]

Chromium runs with a fresh profile and without background networking (the page is a local,
self-contained file; nothing is fetched).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from npuq.fsio import atomic_path
from npuq.errors import NpuqError

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(html: str | Path, png: str | Path, width: int = 1100, height: int = 2400, timeout: float = 120) -> Path:
    """Render ``html`` at ``width`` × ``height`` CSS pixels into ``png`` (written atomically)."""
    browser = find_chromium()
    if browser is None:
        raise NpuqError("no Chromium found (looked for " + ", ".join(BROWSERS) + "): apt-get install chromium")
    page = Path(html).resolve()
    if not page.is_file():
        raise NpuqError(f"{html}: no such file")
    with tempfile.TemporaryDirectory(prefix="npuq-chromium-") as work:
        profile, shot = Path(work) / "profile", Path(work) / "shot.png"  # Chromium wants a .png name
        command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-quic",
                   "--disable-background-networking", "--disable-component-update", "--disable-sync",
                   "--hide-scrollbars", f"--user-data-dir={profile}", f"--window-size={width},{height}",
                   f"--screenshot={shot}", page.as_uri()]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0 or not shot.is_file() or shot.stat().st_size == 0:
            raise NpuqError(f"Chromium failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        with atomic_path(png) as tmp:
            shutil.copyfile(shot, tmp)
    return Path(png)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("html")
    p.add_argument("png")
    p.add_argument("--width", type=int, default=1100)
    p.add_argument("--height", type=int, default=2400)
    args = p.parse_args(argv)
    try:
        print(screenshot(args.html, args.png, args.width, args.height))
    except NpuqError as exc:
        print(f"npuq: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
