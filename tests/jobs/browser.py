"""Find (or install) headless Chromium and run it on local HTML files; for report tests.

``ensure_chromium()`` returns ``(path, "")`` or ``(None, reason)``; the result is cached per
process. Lookup order: ``$INFOFORM_CHROMIUM``, then ``chromium`` / ``chromium-browser`` /
``google-chrome`` on the PATH and in ``/usr/bin``. When none is found and we are root on a
Debian-like machine with ``apt-get``, it runs ``apt-get update`` and
``apt-get install -y chromium`` (with timeouts and apt's lock timeout) unless
``INFOFORM_NO_INSTALL=1``. The reason for a failure is a one-line string for ``pytest.skip``.

Chromium runs with ``--headless --no-sandbox --disable-gpu --disable-quic --no-first-run
--disable-background-networking --disable-component-update --disable-sync`` and a fresh
``--user-data-dir`` per call, so nothing leaves the machine and no profile state is shared.

- :func:`screenshot` -> PNG of the viewport (``--screenshot``, ``--window-size``).
- :func:`dump_dom` -> the serialised DOM after load (``--dump-dom``, ``--virtual-time-budget``).
- :func:`with_check_script` appends a script to a page that, on ``load``, writes
  ``<div id="infoform-check">{json}</div>`` with the number of images, how many decoded
  (``complete && naturalWidth > 0``), their boxes, and the body rows of a table;
  :func:`read_check` parses it back from a DOM dump.
"""
from __future__ import annotations

import functools
import html
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
)
APT_UPDATE_TIMEOUT_S = 300
APT_INSTALL_TIMEOUT_S = 900
RUN_TIMEOUT_S = 120
CHECK_ID = "infoform-check"


def find_chromium() -> str | None:
    """Path of an installed Chromium/Chrome binary, or None."""
    env = os.environ.get("INFOFORM_CHROMIUM")
    if env:
        return env if os.access(env, os.X_OK) else None
    for name in CHROMIUM_NAMES:
        for cand in (shutil.which(name), f"/usr/bin/{name}"):
            if cand and os.access(cand, os.X_OK):
                return cand
    return None


def _tail(text: str, n: int = 300) -> str:
    return " ".join(text.split())[-n:]


def _install() -> str:
    """Try ``apt-get install -y chromium``; return "" on success, else the reason."""
    if os.environ.get("INFOFORM_NO_INSTALL") == "1":
        return "chromium not found and INFOFORM_NO_INSTALL=1"
    if not shutil.which("apt-get"):
        return "chromium not found and apt-get is not available to install it"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "chromium not found and not running as root, so `apt-get install -y chromium` cannot run"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    lock = ["-o", "DPkg::Lock::Timeout=300"]
    steps = ((["apt-get", *lock, "update"], APT_UPDATE_TIMEOUT_S),
             (["apt-get", *lock, "install", "-y", "chromium"], APT_INSTALL_TIMEOUT_S))
    for cmd, timeout in steps:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(cmd)}` timed out after {timeout} s"
        except OSError as e:
            return f"`{' '.join(cmd)}` could not run: {e}"
        if proc.returncode != 0:
            return f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {_tail(proc.stderr or proc.stdout)}"
    return ""


@functools.lru_cache(maxsize=1)
def ensure_chromium() -> tuple[str | None, str]:
    """``(path, "")`` when Chromium is available (installing it if needed), else ``(None, reason)``."""
    path = find_chromium()
    if path:
        return path, ""
    reason = _install()
    if reason:
        return None, reason
    path = find_chromium()
    if not path:
        return None, "apt-get install -y chromium succeeded but no chromium binary was found"
    return path, ""


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    path, reason = ensure_chromium()
    if path is None:
        raise RuntimeError(reason)
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        cmd = [path, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, HOME=profile))
    if proc.returncode != 0:
        raise RuntimeError(f"chromium exited {proc.returncode}: {_tail(proc.stderr, 800)}")
    return proc


def screenshot(page: str | Path, png: str | Path, window: tuple[int, int] = (1400, 3000),
               timeout: float = RUN_TIMEOUT_S, budget_ms: int = 5000) -> Path:
    """Render ``page`` (a local HTML file) and write a screenshot of the viewport to ``png``."""
    page, png = Path(page).resolve(), Path(png).resolve()
    _run([f"--screenshot={png}", f"--window-size={window[0]},{window[1]}", "--run-all-compositor-stages-before-draw",
          f"--virtual-time-budget={budget_ms}", page.as_uri()], timeout)
    if not png.is_file() or png.stat().st_size == 0:
        raise RuntimeError(f"chromium wrote no screenshot to {png}")
    return png


def dump_dom(page: str | Path, window: tuple[int, int] = (1400, 3000), timeout: float = RUN_TIMEOUT_S,
             budget_ms: int = 5000) -> str:
    """The DOM of ``page`` serialised after load (and ``budget_ms`` of virtual time)."""
    page = Path(page).resolve()
    return _run(["--dump-dom", f"--window-size={window[0]},{window[1]}", f"--virtual-time-budget={budget_ms}",
                 page.as_uri()], timeout).stdout


_CHECK_JS = """
<script>
window.addEventListener("load", function () {
  var imgs = Array.prototype.slice.call(document.images);
  var t = document.getElementById(%(table)s);
  var rows = t && t.tBodies.length ? t.tBodies[0].rows.length : -1;
  var out = {
    images: imgs.length,
    loaded: imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length,
    boxes: imgs.map(function (i) {
      var r = i.getBoundingClientRect();
      return [r.left + window.scrollX, r.top + window.scrollY, r.width, r.height, i.naturalWidth, i.naturalHeight];
    }),
    rows: rows,
    keys: t ? Array.prototype.map.call(t.tBodies[0].rows, function (r) { return r.getAttribute("data-key"); }) : [],
    height: document.documentElement.scrollHeight,
    right: t ? Math.ceil(t.getBoundingClientRect().right) : -1,
    viewport: document.documentElement.clientWidth
  };
  var d = document.createElement("div");
  d.id = %(check)s;
  d.textContent = JSON.stringify(out);
  document.body.appendChild(d);
});
</script>
"""


def with_check_script(page_html: str, table_id: str = "methods-table") -> str:
    """``page_html`` with the check script inserted before ``</body>`` (or appended)."""
    script = _CHECK_JS % {"table": json.dumps(table_id), "check": json.dumps(CHECK_ID)}
    idx = page_html.rfind("</body>")
    return page_html + script if idx < 0 else page_html[:idx] + script + page_html[idx:]


def read_check(dom: str) -> dict:
    """The JSON written by :func:`with_check_script`, parsed from a ``--dump-dom`` output."""
    m = re.search(r'<div id="%s">(.*?)</div>' % re.escape(CHECK_ID), dom, re.S)
    if not m:
        raise AssertionError(f"no #{CHECK_ID} element in the dumped DOM (the page's load event did not run?): "
                             f"{_tail(dom, 400)}")
    return json.loads(html.unescape(m.group(1)))
