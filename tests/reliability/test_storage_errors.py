"""Disk full / unwritable output: one clear message, exit status 2, nothing already written lost."""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest

from eagle.cli.app import compose, save_resolved_config, storage_error_message
from eagle.errors import EagleError


def test_unwritable_output_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cfg = compose([f"output_dir={blocker / 'run'}"])
    with pytest.raises(EagleError, match="output_dir=.*not writable"):
        save_resolved_config(cfg, "capture")


@pytest.mark.parametrize(
    "code,reason", [(errno.ENOSPC, "disk is full"), (errno.EROFS, "read-only"), (errno.EACCES, "permission denied")]
)
def test_storage_errors_get_one_message(code, reason):
    message = storage_error_message("capture", OSError(code, "boom", "/data/shard-00003.safetensors.tmp"))
    assert reason in message and "shard-00003" in message and "resume" in message


def test_other_os_errors_are_not_disguised():
    assert storage_error_message("train", OSError(errno.EINVAL, "bad")) is None


@pytest.mark.slow  # a console script in a subprocess
def test_cli_exits_2_with_the_message_on_an_unwritable_output_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    proc = subprocess.run(
        [sys.executable, "-m", "eagle.cli.capture", f"output_dir={blocker / 'run'}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "not writable" in proc.stderr and "Traceback" not in proc.stderr
    assert blocker.read_text() == "keep me"
