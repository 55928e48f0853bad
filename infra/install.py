"""Install the project into the virtual environment that runs this script, with uv where it can
be had and with pip otherwise: ``.venv/bin/python infra/install.py '.[dev,bench,timm]'`` (what
`make install` / `make install-demo` run). Standard library only.

uv (astral-sh/uv, installed into the venv from the same index as everything else) resolves the
same versions as pip and installs them several times faster: on a 2-core machine the full install
took 35 s against pip's ~115 s, and a second venv (the fresh-clone demo's, from uv's cache) 16 s
against ~90 s (issue 43; benchmarks/RESULTS.md). It byte-compiles what it installs, as pip does
(where ``PYTHONDONTWRITEBYTECODE`` is set, nothing would be compiled later and every Ray worker
would compile torch on each import).

uv reads none of pip's configuration, so the settings pip would use here (``pip config list``:
its files and ``PIP_*`` variables) are passed to it: index URL, extra index URLs, find-links,
constraint files, ``no-index``, trusted hosts and the certificate bundle. Like pip it takes the
best match across every index (``--index-strategy unsafe-best-match``), so both resolve alike.
If uv cannot be installed (no index that has it) or its install fails, one line says so and pip
installs as before.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

# pip setting -> uv flag, for the settings that hold one or more values (space-separated in pip).
_LIST_FLAGS = {"extra-index-url": "--extra-index-url", "find-links": "--find-links",
               "constraint": "--constraint", "trusted-host": "--allow-insecure-host"}
# The sections of `pip config list` that apply to `pip install`, lowest precedence first: [global],
# then [install], then the PIP_* variables (":env:"); within one, a later file (user, site) wins.
_SCOPES = ("global", "install", ":env:")


def pip_settings(python: str) -> dict[str, str]:
    """pip's effective settings for ``python``'s pip (see :func:`parse_pip_config`)."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    return parse_pip_config(out)


def parse_pip_config(listing: str) -> dict[str, str]:
    """Settings by name from ``pip config list``'s lines (``global.find-links='/opt/wheels'``,
    ``:env:.cert='...'``): each the value of the highest-precedence scope that sets it."""
    ranked: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        key, sep, raw = line.partition("=")
        if not sep or "." not in key:
            continue
        scope, _, name = key.rpartition(".")
        if scope not in _SCOPES:  # another command's section ([download], [wheel], ...)
            continue
        rank = _SCOPES.index(scope)
        try:
            value = str(ast.literal_eval(raw))
        except (ValueError, SyntaxError):
            value = raw.strip("'\"")
        if name not in ranked or rank >= ranked[name][0]:
            ranked[name] = (rank, value)
    return {name: value for name, (_, value) in ranked.items()}


def uv_arguments(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The uv flags and environment variables that carry pip's ``settings``."""
    args, env = ["--index-strategy", "unsafe-best-match"], {}
    if settings.get("index-url"):
        args += ["--index-url", settings["index-url"]]
    for name, flag in _LIST_FLAGS.items():
        for value in settings.get(name, "").split():
            args += [flag, value]
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        args.append("--no-index")
    if settings.get("cert") and "SSL_CERT_FILE" not in os.environ:
        env["SSL_CERT_FILE"] = settings["cert"]
    return args, env


def install(spec: str) -> int:
    """Install ``spec`` editable into this interpreter's venv; pip's exit code when uv could not."""
    python = sys.executable
    uv = Path(python).with_name("uv")
    got_uv = subprocess.run([python, "-m", "pip", "install", "--quiet", "uv"]).returncode == 0 and uv.exists()
    if got_uv:
        args, env = uv_arguments(pip_settings(python))
        cmd = [str(uv), "pip", "install", "--python", python, "--compile-bytecode", *args, "-e", spec]
        # not the flags: an index URL can carry a user and token (never logged)
        print(f"install: uv pip install -e {spec} with pip's index settings", flush=True)
        rc = subprocess.run(cmd, env={**os.environ, **env}).returncode
        if rc == 0:
            return 0
        print(f"install: uv exited {rc}; installing with pip instead", flush=True)
    else:
        print("install: uv could not be installed; installing with pip", flush=True)
    return subprocess.run([python, "-m", "pip", "install", "-e", spec]).returncode


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: .venv/bin/python infra/install.py SPEC   (e.g. '.[dev,bench,timm]')", file=sys.stderr)
        return 2
    if sys.prefix == sys.base_prefix:
        print(f"install: {sys.executable} is not a virtual environment's Python; run it as .venv/bin/python",
              file=sys.stderr)
        return 2
    return install(argv[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
