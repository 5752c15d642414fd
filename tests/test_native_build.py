"""Building and loading the native CPU kernels (radixserve/native_build.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
from types import ModuleType

from radixserve.native_build import build_folder, build_in_background, native_module

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


def test_a_getter_called_during_its_build_waits_for_that_build() -> None:
    """A worker builds its modules on background threads while the model loads; a kernel
    called meanwhile must wait for the running build, not start a second one."""
    release, builds = threading.Event(), []

    @native_module
    def getter() -> ModuleType | None:
        builds.append(threading.current_thread().name)
        assert release.wait(timeout=30)
        return ModuleType("built")

    build_in_background(getter)
    results: list[ModuleType | None] = []
    caller = threading.Thread(target=lambda: results.append(getter()))
    caller.start()
    caller.join(timeout=0.5)
    assert caller.is_alive() and not results  # waiting for the background build
    release.set()
    caller.join(timeout=30)
    assert builds == ["native build"]
    assert len(results) == 1 and results[0] is getter()
