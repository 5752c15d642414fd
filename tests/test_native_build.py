"""Building and loading the native CPU kernels (radixserve/native_build.py)."""

from __future__ import annotations

import subprocess
import sys

from radixserve.native_build import build_folder

LOAD_TIMEOUT_S = 120  # loading a built module takes about a second; a wait on a lock never ends


def test_a_lock_left_by_a_killed_build_does_not_stop_later_loads() -> None:
    """A process killed while building leaves torch's lock file in the module's folder; the
    next process must still load the module (built here by the session fixture)."""
    stale = build_folder("radixserve_fused_cpu") / "lock"
    stale.touch()
    load = "from radixserve.models import native; assert native.ops() is not None"
    done = subprocess.run(
        [sys.executable, "-c", load], capture_output=True, text=True, timeout=LOAD_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not stale.exists()
    assert "left by a build that was killed" in done.stderr
