"""The run-directory lock itself: a file is not a directory, a dead holder's lock is taken over
with a note, one process may take its own lock again, and an unwritable place is a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kernelmix.errors import KernelmixError, RunDirectoryBusy
from kernelmix.locks import HOLDER_NAME, run_directory_lock


class TestLockOnAFile:
    def test_a_file_is_refused_with_the_fix(self, tmp_path):
        target = tmp_path / "file"
        target.write_text("x")
        with pytest.raises(KernelmixError, match=r"is a file, not a run directory: pass an --out that is a directory"):
            with run_directory_lock(target, "kernelmix train"):
                pass


class TestLockLeftByADeadProcess:
    def test_taken_over_with_a_note(self, tmp_path, capsys):
        code = ("import os; from kernelmix.locks import run_directory_lock\n"
                f"with run_directory_lock({str(tmp_path)!r}, 'kernelmix train'):\n    os._exit(3)\n")
        assert subprocess.run([sys.executable, "-c", code]).returncode == 3
        dead = json.loads((tmp_path / HOLDER_NAME).read_text())
        with run_directory_lock(tmp_path, "kernelmix compare"):
            holder = json.loads((tmp_path / HOLDER_NAME).read_text())
        assert holder["pid"] == os.getpid() and holder["command"] == "kernelmix compare"
        err = capsys.readouterr().err
        assert f"taking over {tmp_path}'s lock, left by `kernelmix train` (pid {dead['pid']}" in err
        assert "no longer running" in err
        assert not (tmp_path / HOLDER_NAME).exists()  # released: the holder file goes with the lock


class TestLockIsReentrantInOneProcess:
    def test_inner_lock_keeps_the_outer_holder(self, tmp_path):
        with run_directory_lock(tmp_path, "kernelmix compare"):
            with run_directory_lock(tmp_path, "kernelmix train"):
                assert json.loads((tmp_path / HOLDER_NAME).read_text())["command"] == "kernelmix compare"
            assert (tmp_path / HOLDER_NAME).exists()  # the inner release does not free the outer lock


class TestLockHeldByALiveProcess:
    def test_second_writer_names_the_holder(self, tmp_path):
        code = ("import sys, time; from kernelmix.locks import run_directory_lock\n"
                f"with run_directory_lock({str(tmp_path)!r}, 'kernelmix report'):\n"
                "    print('held', flush=True); sys.stdin.readline()\n")
        holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            with pytest.raises(RunDirectoryBusy,
                               match=rf"`kernelmix report` \(pid {holder.pid} on .*write to another "):
                with run_directory_lock(tmp_path, "kernelmix train"):
                    pass
        finally:
            holder.communicate("\n")


class TestLockWhereNothingCanBeWritten:
    def test_path_through_a_file(self, tmp_path):
        (tmp_path / "file").write_text("x")
        with pytest.raises(KernelmixError, match=r"cannot create the run directory .*choose another --out"):
            with run_directory_lock(tmp_path / "file" / "run", "kernelmix train"):
                pass
