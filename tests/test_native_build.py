"""The native kernels' build (kernels/native/build.py): its lock survives a killed holder, it says
what it does on stderr, and its key covers the interpreter and include paths. Stand-in builds
where possible: the real one takes minutes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rwkv_engine.kernels import native
from rwkv_engine.kernels.native import build

pytestmark = pytest.mark.skipif(build.fcntl is None, reason="no fcntl here")

# Holds the build lock of argv[1] and leaves torch's lock file there, as a build mid-way does.
_HOLDER = r"""
import sys, time
from pathlib import Path
from rwkv_engine.kernels.native import build
d = Path(sys.argv[1])
with build.build_lock(d, "a test build"):
    (d / "lock").write_text("")
    print("held", flush=True)
    time.sleep(600)
"""

# Takes the lock, then waits on torch's lock file as torch's extension build does.
_WAITER = r"""
import sys
from pathlib import Path
from torch.utils.file_baton import FileBaton
from rwkv_engine.kernels.native import build
d = Path(sys.argv[1])
with build.build_lock(d, "a test build"):
    baton = FileBaton(str(d / "lock"))
    if baton.try_acquire():
        baton.release()
    else:
        baton.wait()
print("built", flush=True)
"""


def _start_holder(d: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(d)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_killed_lock_holder_is_detected_at_once(tmp_path):
    holder = _start_holder(tmp_path)
    waiter = subprocess.Popen(
        [sys.executable, "-c", _WAITER, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = waiter.stderr.readline()  # said before it blocks
        assert f"waiting for process {holder.pid}, which is building a test build" in line, line
        assert waiter.poll() is None
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        t0 = time.monotonic()
        out, _ = waiter.communicate(timeout=60)
        assert out.strip() == "built"
        assert time.monotonic() - t0 < 30
    finally:
        for p in (holder, waiter):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_load_proceeds_past_a_killed_build_of_the_real_bindings(tmp_path):
    """A build killed mid-way left torch's lock file in the real build directory: the next
    process loads the (cached) module at once instead of waiting on it."""
    if native.load() is None:
        pytest.skip("native kernels unavailable here")
    lv, _ = native.choose_level(os.environ.get(native.ENV))
    base = next(x for x in native.LEVELS if x.arch == lv.arch)
    _, build_dir = build._bindings_dir(base)
    holder = _start_holder(build_dir)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert (build_dir / "lock").exists()
    code = "from rwkv_engine.kernels import native; print(native.isa())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == native.isa()
    assert "building" not in r.stderr  # cached: only loaded


def test_the_bindings_key_covers_the_interpreter_and_include_paths(monkeypatch):
    from torch.utils import cpp_extension

    base = native.LEVELS[0]
    name = build._bindings_dir(base)[0]
    monkeypatch.setattr(sys, "executable", "/elsewhere/venv/bin/python")
    other_python = build._bindings_dir(base)[0]
    monkeypatch.undo()
    monkeypatch.setattr(cpp_extension, "include_paths", lambda *a, **k: ["/elsewhere/venv/torch/include"])
    other_includes = build._bindings_dir(base)[0]
    assert len({name, other_python, other_includes}) == 3


class _FakeOps:
    def use_kernels(self, path):
        self.path = path


def test_a_build_says_so_on_stderr_first_and_last(tmp_path, monkeypatch, capsys):
    """A first run says at once what it builds (minutes of silence otherwise) and how long it took;
    a cached one says nothing."""
    lv = native.LEVELS[-1]
    lib = tmp_path / "kernels.so"
    monkeypatch.setattr(build, "_bindings_dir", lambda base: ("stand_in", tmp_path / "bindings"))
    monkeypatch.setattr(build, "library_path", lambda lv: lib)

    def fake_bindings(base, name, build_dir, verbose):
        so = build_dir / f"{name}.so"
        if not so.exists():
            assert "building the native kernels" in capsys.readouterr().err  # before the build starts
            so.write_bytes(b"")
        return _FakeOps()

    def fake_kernels(lv):
        lib.write_bytes(b"")
        return lib

    monkeypatch.setattr(build, "_load_bindings", fake_bindings)
    monkeypatch.setattr(build, "build_kernels", fake_kernels)
    assert build.load_module(lv).path == str(lib)
    err = capsys.readouterr().err
    assert err.startswith("rwkv-engine: native kernels built in ") and err.endswith(" s\n"), err
    build.load_module(lv)
    assert capsys.readouterr().err == ""


def test_the_first_build_line_names_the_level(tmp_path, monkeypatch, capsys):
    lv = native.level("avx2")
    monkeypatch.setattr(build, "_bindings_dir", lambda base: ("stand_in", tmp_path))
    monkeypatch.setattr(build, "_load_bindings", lambda *a: _FakeOps())
    monkeypatch.setattr(build, "build_kernels", lambda lv: tmp_path / "k.so")
    build.load_module(lv)
    first = capsys.readouterr().err.splitlines()[0]
    assert first == "rwkv-engine: building the native kernels for this CPU (avx2), once: 1-3 minutes"
