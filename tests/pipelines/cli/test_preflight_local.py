"""A local output that cannot be written is named as a local path: no S3 endpoint or
credentials in the line (they were named for any path before)."""
from __future__ import annotations

import pytest

from pipelines.cli.preflight import check_writable
from pipelines.errors import PreflightError
from pipelines.storage import uris as storage


def test_an_unwritable_local_output_names_the_path_and_its_cause_not_an_s3_endpoint(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(PreflightError) as e:
        check_writable(str(blocker / "out"), storage.StorageOptions())
    msg = str(e.value)
    assert msg.startswith(f"output is not writable: {blocker / 'out'} (") and "NotADirectoryError" in msg, msg
    assert "AWS" not in msg and "endpoint" not in msg, msg
