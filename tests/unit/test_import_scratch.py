"""A temporary folder an import makes (wandb's, when TRL imports it) does not outlive its process: it goes
under the process's own folder, which a later raytrainer process removes once the process is gone, or the
process itself at a normal exit (raytrainer/import_scratch.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from raytrainer.import_scratch import PREFIX, reap

#: A module that does at import what wandb does (wandb/sdk/data_types/_private.py: ``MEDIA_TMP``).
MODULE = "import tempfile\nKEPT = tempfile.TemporaryDirectory('wandb-media')\n"


def child(tmp_path, body: str, **popen) -> subprocess.Popen:
    (tmp_path / "mods").mkdir(exist_ok=True)
    (tmp_path / "mods" / "makes_tmp.py").write_text(MODULE)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(tmp_path / "mods")!r})
        from raytrainer.import_scratch import imports_in_own_folder
    """) + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(tmp_path / "tmp")},
                            stdout=subprocess.PIPE, text=True, **popen)


def test_a_killed_processes_import_folders_are_kept_in_its_own_folder_and_reaped_once_it_is_gone(tmp_path):
    # Without the folder, the import's folder outlives a process that ends as a Ray worker does.
    bare = child(tmp_path, "import makes_tmp\nprint(makes_tmp.KEPT.name, flush=True)\nos._exit(0)\n")
    left = bare.communicate(timeout=60)[0].strip()
    assert os.path.dirname(left) == str(tmp_path / "tmp") and os.path.isdir(left)
    os.rmdir(left)

    kept = child(tmp_path, """
        with imports_in_own_folder():
            import makes_tmp
        import tempfile
        print(makes_tmp.KEPT.name, tempfile.gettempdir(), flush=True)
        os._exit(0)
    """)
    made, after = kept.communicate(timeout=60)[0].split()
    own = os.path.dirname(made)
    assert os.path.basename(own).startswith(f"{PREFIX}{kept.pid}-")
    assert after == str(tmp_path / "tmp")  # only the imports moved: tempfile's folder is back
    assert os.listdir(tmp_path / "tmp") == [os.path.basename(own)] and os.path.isdir(made)

    assert reap(str(tmp_path / "tmp")) == [os.path.basename(own)]
    assert os.listdir(tmp_path / "tmp") == []


def test_a_live_processes_folder_is_kept_and_goes_at_its_normal_exit(tmp_path):
    live = child(tmp_path, """
        with imports_in_own_folder():
            import makes_tmp
        print(makes_tmp.KEPT.name, flush=True)
        sys.stdin.read()  # until the test closes stdin: then a normal exit
    """, stdin=subprocess.PIPE)
    made = live.stdout.readline().strip()
    assert reap(str(tmp_path / "tmp")) == [] and os.path.isdir(made)
    # a dead process's folder whose PID is now this live process's: its start time tells them apart
    recycled = tmp_path / "tmp" / f"{PREFIX}{live.pid}-1"
    recycled.mkdir()
    assert reap(str(tmp_path / "tmp")) == [recycled.name] and os.path.isdir(made)
    live.communicate("", timeout=60)
    assert live.returncode == 0 and os.listdir(tmp_path / "tmp") == []
