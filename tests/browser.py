"""Headless Chromium for tests of the HTML report: the DOM after its scripts ran, a
screenshot, and the network requests the page made (from Chromium's NetLog).

Needs the ``chromium`` binary (Debian: ``apt-get install chromium``); tests skip without it.
Every run gets its own profile folder and no network: background services are off, and a
request the page would make is recorded in the NetLog, not answered.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from pathlib import Path

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--hide-scrollbars",
    "--mute-audio",
)


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def run(
    page: Path, tmp: Path, *args: str, fragment: str = "", timeout: float = 120
) -> subprocess.CompletedProcess:
    binary = chromium()
    assert binary is not None
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    url = page.resolve().as_uri() + (f"#{fragment}" if fragment else "")
    return subprocess.run(
        [binary, *FLAGS, f"--user-data-dir={profile}", *args, url],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def dump_dom(page: Path, tmp: Path, netlog: Path | None = None) -> str:
    """The page's DOM once it loaded and its scripts ran."""
    extra = [f"--log-net-log={netlog}", "--net-log-capture-mode=Default"] if netlog else []
    p = run(page, tmp, *extra, "--dump-dom")
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def screenshot(page: Path, tmp: Path, out: Path, width: int = 1280, height: int = 900) -> None:
    p = run(page, tmp, f"--window-size={width},{height}", f"--screenshot={out}")
    assert p.returncode == 0 and out.exists(), p.stderr[-2000:]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def page_requests(netlog: Path) -> list[str]:
    """URLs the page itself asked for (requests whose network isolation key is the file://
    page), other than file: and data: URLs. Chromium's own background requests, if any,
    carry another key and are not the page's."""
    log = json.loads(netlog.read_text())
    kinds = {v: k for k, v in log["constants"]["logEventTypes"].items()}
    urls = []
    for event in log["events"]:
        params = event.get("params") or {}
        if kinds.get(event["type"]) != "URL_REQUEST_START_JOB" or "url" not in params:
            continue
        if not str(params.get("network_isolation_key", "")).startswith("file://"):
            continue
        if not params["url"].startswith(("file:", "data:")):
            urls.append(params["url"])
    return urls
