"""infra/install.py (what `make install` runs): pip's settings reach uv. The install itself runs in
every `make test` (this checkout's venv, and the fresh-clone demo's in tests/jobs/test_demo_fresh.py)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("infra_install", ROOT / "infra" / "install.py")
install = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(install)

LISTING = """\
global.cert='/etc/ssl/certs/ca.crt'
global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'
global.find-links='/opt/old'
global.constraint='/etc/pip/constraints.txt'
install.index-url='https://mirror.example/simple'
download.index-url='https://elsewhere.example/simple'
:env:.find-links='/opt/wheels /opt/more'
:env:.default-timeout='180'
not a setting
"""


def test_the_highest_scope_wins_and_values_keep_their_text():
    s = install.parse_pip_config(LISTING)
    assert s["find-links"] == "/opt/wheels /opt/more"  # the environment over the global file
    assert s["index-url"] == "https://mirror.example/simple"  # [install]; [download] is another command's
    assert s["extra-index-url"] == "file:///opt/a/simple file:///opt/b/simple"
    assert "not a setting" not in s and len(s) == 6


def test_pip_settings_become_uv_flags(monkeypatch):
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    args, env = install.uv_arguments(install.parse_pip_config(LISTING) | {"no-index": "true"})
    pairs = list(zip(args[::2], args[1::2]))
    assert pairs[0] == ("--index-strategy", "unsafe-best-match")
    assert ("--index-url", "https://mirror.example/simple") in pairs
    assert [v for f, v in pairs if f == "--extra-index-url"] == ["file:///opt/a/simple", "file:///opt/b/simple"]
    assert [v for f, v in pairs if f == "--find-links"] == ["/opt/wheels", "/opt/more"]
    assert ("--constraint", "/etc/pip/constraints.txt") in pairs
    assert args[-1] == "--no-index" and env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca.crt"}


def test_outside_a_venv_it_refuses_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(install.sys, "prefix", install.sys.base_prefix)
    assert install.main([".[dev]"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert install.main([]) == 2
