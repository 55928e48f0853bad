"""Several named OOD sets (issue 39): ``--ood NAME=URI`` (repeatable; a bare URI is named after its
folder), the config's list of ``{name, uri, group, limit}``, the old single ``data.ood`` string,
and the refusals (a bad or duplicate name, a missing folder): one line, exit 2, before any cluster."""
from __future__ import annotations

import time

import pytest

from pipelines.cli.main import config_from_args, get_args_parser, main
from pipelines.cli.preflight import preflight
from pipelines.config.load import load_config
from pipelines.errors import PreflightError

REFUSE_WITHIN_S = 10.0  # the "in seconds", in-process (no interpreter start-up)


def _cfg(*argv: str):
    return config_from_args(get_args_parser().parse_args(["--preset", "smoke", *argv]))


def test_repeated_flags_bare_uri_and_the_old_string_normalise_to_one_list(tmp_path):
    cfg = _cfg("--ood", f"letters={tmp_path}/a", "--ood", f"{tmp_path}/random-noise/")
    assert [(o.name, o.uri, o.group) for o in cfg.data.ood] == [
        ("letters", f"{tmp_path}/a", None), ("random-noise", f"{tmp_path}/random-noise/", None)]
    old = load_config("smoke", ["data.ood=s3://bucket/year=2024/ninco"]).data.ood  # '=' inside a path is a path
    assert [(o.name, o.uri) for o in old] == [("ninco", "s3://bucket/year=2024/ninco")]
    assert load_config("smoke", ["data.ood=null"]).data.ood == ()
    listed = load_config("smoke", ["data.ood=[{name: ssb, uri: s3://b/ssb, group: near, limit: 7}, "
                                   "{uri: /d/inat, group: far}]"]).data.ood
    assert [(o.name, o.group, o.limit) for o in listed] == [("ssb", "near", 7), ("inat", "far", None)]


@pytest.mark.parametrize("argv, words", [
    (["--ood", "a=/x", "--ood", "a=/y"], ("data.ood", "'a'", "twice")),
    (["--ood", "/d/a", "--ood", "a=/e/b"], ("data.ood", "'a'", "twice")),  # a bare folder's name counts
    (["--ood", "b@d=/x"], ("data.ood", "name", "'b@d'")),
    (["--ood", "near=/x"], ("data.ood", "name", "group")),
    (["--set", "data.ood=[{uri: /x, group: middle}]"], ("data.ood", "group", "near, far")),
])
def test_a_bad_or_duplicate_name_is_one_line_exit_2(argv, words, capsys):
    t0 = time.perf_counter()
    assert main(["run", "--preset", "smoke", "--dry-run", *argv]) == 2
    assert time.perf_counter() - t0 < REFUSE_WITHIN_S
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and all(w in lines[0] for w in words), lines


def test_preflight_checks_every_ood_folder_and_names_the_set(tmp_path):
    (tmp_path / "letters").mkdir()
    cfg = _cfg("--output", str(tmp_path / "out"), "--ood", f"letters={tmp_path}/letters",
               "--ood", f"noise={tmp_path}/noise")
    with pytest.raises(PreflightError) as e:
        preflight(cfg)
    msg = str(e.value)
    assert "OOD folder not found" in msg and f"{tmp_path}/noise" in msg and "'noise'" in msg and "\n" not in msg
    (tmp_path / "noise").mkdir()
    preflight(cfg)  # both there: passes
