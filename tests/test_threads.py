"""rwkv_engine/threads.py: one OpenMP team at a time (the engine's), and libgomp's spin.

Each check runs in a fresh interpreter: OpenMP's teams and settings belong to a process, and the
test process has run parallel regions on many threads already."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not torch.backends.openmp.is_available(),
    reason="counts the threads of /proc/self/task; needs torch's OpenMP",
)

# A script's helpers: the process's threads, and waiting for a thread to exit.
PRELUDE = textwrap.dedent(
    """
    import os, sys, threading, time
    import torch
    torch.set_num_threads(2)

    def tids():
        return set(os.listdir("/proc/self/task"))

    def region():  # a parallel region on the calling thread (an add far over torch's grain size)
        (torch.ones(1 << 20) + 1).sum()

    def gone(tid, seconds=5.0):
        end = time.time() + seconds
        while tid in tids() and time.time() < end:
            time.sleep(0.01)
        return tid not in tids()
    """
)


def run(script: str, env: dict | None = None) -> str:
    import os

    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_release_frees_the_callers_openmp_workers():
    """A parallel region starts a worker for the calling thread, which lives on after it;
    `release_openmp_threads` ends it, and the thread's next region starts one again."""
    out = run(
        """
        from rwkv_engine.threads import release_openmp_threads
        before = tids()
        region()
        workers = tids() - before
        assert len(workers) == 1, workers  # two threads: the caller and one worker
        assert release_openmp_threads() is True
        assert all(gone(t) for t in workers)
        region()
        assert len(tids() - before) == 1  # started again
        print("ok")
        """
    )
    assert out == "ok"


def test_the_engine_frees_the_openmp_workers_of_the_thread_that_starts_it(tmp_path):
    """The thread that loaded the model ran parallel regions; once the engine starts, that
    thread's worker is gone (with it alive, every region of the engine thread waited for a
    sleeping worker: rwkv_engine/threads.py), and the engine serves."""
    from rwkv_engine.testing import random_state_dict, save_pth

    path = tmp_path / "m.pth"
    save_pth(random_state_dict(version="7", n_layer=2, n_embd=64, vocab_size=65536, head_size=16), path)
    out = run(
        f"""
        import rwkv_engine
        from rwkv_engine import SamplingParams
        from rwkv_engine.serve.engine import Engine, EngineConfig, Finished, Request
        from rwkv_engine.threads import release_openmp_threads
        model = rwkv_engine.load({str(path)!r}, dtype="fp32")
        release_openmp_threads()  # (so that the worker below is the one region() starts)
        before = tids()
        region()
        workers = tids() - before
        assert len(workers) == 1, workers
        engine = Engine(model, rwkv_engine.load_tokenizer(model), EngineConfig(max_batch=2))
        engine.start()
        assert all(gone(t) for t in workers)
        done = threading.Event()
        engine.submit(Request([1, 2, 3], SamplingParams(temperature=0, max_tokens=4)),
                      lambda e: done.set() if isinstance(e, Finished) else None)
        assert done.wait(120)
        engine.stop()
        print("ok")
        """
    )
    assert out == "ok"


def test_releasing_frees_the_workers_of_a_helper_threads_job():
    """`releasing(fn)`: a job on a helper thread (as `asyncio.to_thread` runs it) that opened a
    parallel region leaves no worker behind, also when it raises."""
    out = run(
        """
        from concurrent.futures import ThreadPoolExecutor
        from rwkv_engine.threads import releasing
        pool = ThreadPoolExecutor(1)
        pool.submit(lambda: None).result()  # the helper thread exists
        before = tids()
        pool.submit(region).result()
        left = tids() - before
        assert len(left) == 1, left  # a bare job leaves its worker
        pool.submit(releasing(lambda: None)).result()
        assert all(gone(t) for t in left)
        before = tids()
        def fails():
            region()
            raise ValueError("x")
        try:
            pool.submit(releasing(fails)).result()
        except ValueError:
            pass
        time.sleep(0.05)
        assert all(gone(t) for t in tids() - before)
        print("ok")
        """
    )
    assert out == "ok"


@pytest.mark.parametrize(
    "env, loaded, expect",
    [
        ({}, False, "True 10000"),
        ({"GOMP_SPINCOUNT": "5"}, False, "False 5"),  # the user's choice wins
        ({"OMP_WAIT_POLICY": "PASSIVE"}, False, "False None"),
        ({}, True, "False None"),  # torch loaded: libgomp has read its settings already
    ],
)
def test_configure_openmp_sets_the_spin_only_before_torch_loads_and_if_unset(env, loaded, expect):
    import os

    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    script = (
        "import os, sys\n"
        + ("import torch\n" if loaded else "")
        + "from rwkv_engine.threads import configure_openmp\n"
        + "print(configure_openmp(), os.environ.get('GOMP_SPINCOUNT'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env={**clean, **env}
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == expect


def test_openmp_env_is_the_spin_unless_the_environment_chooses(monkeypatch):
    """What Ray's replicas get in their environment (serve/ray.py): the command's spin, or
    nothing where this process's environment sets a spin or wait policy (they inherit it)."""
    from rwkv_engine.threads import OPENMP_SPIN, openmp_env

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert openmp_env() == {"GOMP_SPINCOUNT": str(OPENMP_SPIN)}
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert openmp_env() == {}
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    assert openmp_env() == {}


def test_use_threads_sets_the_calling_threads_count_only():
    """`use_threads(n)` sets the calling thread's OpenMP and MKL counts and no other thread's
    (the engine thread decodes on some threads while the prefill thread reads on the others):
    a helper's regions then start no worker, while the main thread's still do; and it does not
    go through torch.set_num_threads, which also changes the count later threads get and clears
    PyTorch's cache of oneDNN computations."""
    out = run(
        """
        import ctypes
        from rwkv_engine import threads
        cleared = []
        real = torch.set_num_threads
        torch.set_num_threads = lambda n: (cleared.append(n), real(n))
        mkl = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")).MKL_Get_Max_Threads
        seen = {}

        def helper():
            threads.use_threads(1)
            before = tids()
            region()
            seen.update(omp=torch.get_num_threads(), mkl=mkl(), new=len(tids() - before))

        t = threading.Thread(target=helper)
        t.start()
        t.join()
        before = tids()
        region()
        print(seen["omp"], seen["mkl"], seen["new"], torch.get_num_threads(), mkl(), len(tids() - before), cleared)
        """
    )
    assert out == "1 1 0 2 2 1 []", out
