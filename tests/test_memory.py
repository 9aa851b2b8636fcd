"""rwkv_engine.memory: glibc malloc tuning is applied once, and never against the user's settings."""

import os
import subprocess
import sys

import pytest

CODE = "import rwkv_engine.memory as m; print(m.tune_malloc(), m.tune_malloc())"


def _run(**env):
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_tune_malloc_once_and_respects_user_settings():
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    first, second = _run(**env)
    assert second == "False"  # only the first call acts
    assert _run(RWKV_ENGINE_MALLOC="0") == ["False", "False"]
    assert _run(MALLOC_TRIM_THRESHOLD_="1048576") == ["False", "False"]
