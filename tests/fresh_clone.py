"""The fresh-clone demo's first half, as a new user does it: clone this checkout and `make
install-demo` in the clone (a new venv, one pip command). Standard library only: ``make test``
starts it with the system Python before its own install (``python3.11 tests/fresh_clone.py DIR``,
in the background), so that the two installs share the machine's cores instead of the demo's
install running alone at the suite's end (issue 43); ``tests/jobs/test_demo_fresh.py`` then runs
`make demo` in the prepared clone and checks both halves. Run alone, the test does both itself.

``DIR`` holds ``infoform/`` (the clone), ``install.out`` / ``install.err`` (pip's output) and
``prepared.json`` (written last, atomically: the install's exit code and seconds).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = "prepared.json"


def new_user_env(base: Path) -> dict[str, str]:
    """A new user's shell: not inside this suite's `make test` (MAKELEVEL would add make's
    "Entering/Leaving directory" lines around the demo's own), no venv on the PATH, no Ray
    address, and an infoform cache of its own (a new machine: the demo's CNN is trained)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "RAY_ADDRESS", "MAKELEVEL", "MAKEFLAGS", "MFLAGS"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if "/.venv/" not in p)
    env["INFOFORM_CACHE"] = str(base / "machine-cache")
    return env


def prepare(base: Path) -> dict:
    """Clone into ``base/infoform`` and `make install-demo` there; the result (also written to
    ``base/prepared.json``): ``returncode`` and ``seconds`` of the install."""
    clone = base / "infoform"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=300)
    t0 = time.time()
    with open(base / "install.out", "w") as out, open(base / "install.err", "w") as err:
        rc = subprocess.run(["make", "install-demo"], cwd=clone, env=new_user_env(base), stdout=out, stderr=err,
                            timeout=1200).returncode
    return _write(base, {"returncode": rc, "seconds": time.time() - t0})


def _write(base: Path, result: dict) -> dict:
    tmp = base / (RESULT + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(base / RESULT)
    return result


def prepared(base: Path, timeout: float) -> dict | None:
    """``prepared.json`` of ``base``, waiting up to ``timeout`` s for it; None if it never came."""
    deadline = time.time() + timeout
    while not (base / RESULT).exists():
        if time.time() > deadline:
            return None
        time.sleep(2)
    return json.loads((base / RESULT).read_text())


def main(argv: list[str]) -> int:
    base = Path(argv[0])
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    try:
        prepare(base)
    except Exception as e:  # noqa: BLE001 - the test reads why from here
        with open(base / "install.err", "a") as err:
            err.write(f"the clone or the install failed: {type(e).__name__}: {e}\n")
        _write(base, {"returncode": -1, "seconds": 0.0})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
