"""rwkv_engine.memory: glibc malloc tuning is applied once, and never against the user's settings."""

import os
import subprocess
import sys

import pytest

CODE = "import rwkv_engine.memory as m; print(m.tune_malloc(), m.tune_malloc())"


def _run(**env):
    out = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, env={**os.environ, **env}, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_tune_malloc_once_and_respects_user_settings():
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    first, second = _run(**env)
    assert second == "False"  # only the first call acts
    assert _run(RWKV_ENGINE_MALLOC="0") == ["False", "False"]
    assert _run(MALLOC_TRIM_THRESHOLD_="1048576") == ["False", "False"]


def _rss_file_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    pytest.skip("no RssFile in /proc/self/status")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc accounting")
def test_file_rows_reads_rows_without_mapping_them(tmp_path):
    import copy

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from rwkv_engine.loading.converted import _tensor_offset
    from rwkv_engine.memory import FileRows

    V, C = 65536, 256
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(3), "emb.weight": torch.randn(V, C).to(torch.bfloat16)}, str(path))
    mapped = safe_open(str(path), framework="pt", device="cpu").get_tensor("emb.weight")
    rows = FileRows(path, _tensor_offset(path, "emb.weight"), (V, C), torch.bfloat16, mapped)
    ids = torch.randint(0, V, (4, 128), generator=torch.Generator().manual_seed(0))
    before = _rss_file_kb()
    got = rows.read(ids)
    grown = _rss_file_kb() - before
    # 512 random rows through the mapping would fault in at least 512 pages (2 MB, usually far
    # more with fault-around and large folios); pread maps none of the file.
    assert grown < 1024, f"RssFile grew {grown} kB"
    assert got.shape == (4, 128, C) and torch.equal(got, mapped[ids])
    assert rows.serves(mapped) and not rows.serves(mapped.clone()) and not rows.serves(mapped.float())
    with pytest.raises(IndexError, match="65536"):
        rows.read(torch.tensor([V]))
    with pytest.raises(IndexError):
        rows.read(torch.tensor([-1]))
    twin = copy.deepcopy(rows)  # its own descriptor: closing one leaves the other working
    rows.close()
    assert torch.equal(twin.read(ids[0]), mapped[ids[0]])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc accounting")
def test_spill_moves_a_table_out_of_the_process_and_reads_its_rows(tmp_path):
    import copy
    import pickle

    import torch

    from rwkv_engine.memory import SPILL_MIN_BYTES, spill

    V, C = 65536, 512  # 64 MB of bf16: just spilled
    t = torch.randn(V, C).to(torch.bfloat16)
    assert t.numel() * 2 >= SPILL_MIN_BYTES
    mapped, rows = spill(t, str(tmp_path))
    assert rows is not None and list(tmp_path.iterdir()) == []  # the file has no name left
    assert torch.equal(mapped, t) and rows.serves(mapped)
    ids = torch.tensor([[0, 5, V - 1], [7, 7, 3]])
    assert torch.equal(rows.read(ids), t[ids])
    mapped[5] = 1.5  # an in-place change is what the rows read (a shared mapping)
    assert torch.equal(rows.read(torch.tensor([5])), torch.full((1, C), 1.5, dtype=torch.bfloat16))
    twin = copy.deepcopy(rows)  # no file name to open again: the copy stops serving, never reads stale rows
    assert not twin.serves(mapped)
    assert pickle.loads(pickle.dumps(rows)).serves(mapped) is False
    small = torch.zeros(16, 8)
    assert spill(small, str(tmp_path)) == (small, None)  # small tables stay where they are


def test_a_checkpoint_load_reads_a_big_embedding_from_a_spilled_file(tmp_path):
    """rwkv_engine.load of a checkpoint: the folded embedding (>= 64 MB) is served from a spilled
    file, the model's outputs are those of the in-memory table."""
    import torch

    import rwkv_engine
    from rwkv_engine import testing

    sd = testing.cast(
        testing.random_state_dict("7", n_layer=1, n_embd=1024, vocab_size=32768, head_size=64, seed=1), torch.bfloat16
    )
    path = testing.save_pth(sd, tmp_path / "m.pth")
    model = rwkv_engine.load(path, dtype="bf16", progress=False)
    rows = model.emb.file_rows
    assert rows is not None and rows.serves(model.emb.weight)
    prompt = [1, 2, 3, 32767, 0]
    spilled, _ = model.forward(prompt)
    model.emb.file_rows = None  # the plain lookup of the (mapped) table
    plain, _ = model.forward(prompt)
    assert torch.equal(spilled, plain)


def _thp_in_use() -> bool:
    from rwkv_engine.memory import huge_pages_available

    return huge_pages_available()


def _on_huge_pages(t) -> bool:
    """Whether t's memory is a mapping advised MADV_HUGEPAGE ("hg" in its VmFlags) and 2 MB-aligned."""
    from rwkv_engine.memory import HUGE_PAGE

    p, hit = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's address range
                lo, hi = (int(x, 16) for x in head.split("-"))
                hit = lo <= p < hi
            elif hit and head == "VmFlags:":
                return "hg" in line.split()[1:] and p % HUGE_PAGE == 0
    return False


def test_to_huge_pages_copies_into_its_own_aligned_mapping(monkeypatch):
    import copy
    import gc
    import pickle

    import torch

    from rwkv_engine.memory import HUGE_PAGE, to_huge_pages

    src = torch.randn(512, 1024 + 3)  # > 2 MB, rows not a page multiple
    if not _thp_in_use():
        assert to_huge_pages(src) is src
        pytest.skip("no transparent huge pages here: the copy is skipped (checked)")
    moved = to_huge_pages(src)
    assert moved is not src and torch.equal(moved, src) and _on_huge_pages(moved)
    view = moved[3:5]
    del moved
    gc.collect()
    assert torch.equal(view, src[3:5])  # the mapping lives as long as any view of it
    assert torch.equal(copy.deepcopy(view), src[3:5]) and torch.equal(pickle.loads(pickle.dumps(view)), src[3:5])
    small = torch.randn(16, 16)
    assert to_huge_pages(small) is small  # under one huge page: left where it is
    assert to_huge_pages(src, min_bytes=HUGE_PAGE * 64) is src
    monkeypatch.setenv("RWKV_ENGINE_HUGE_PAGES", "0")
    assert to_huge_pages(src) is src  # the user's opt-out


@pytest.mark.parametrize("source", ["checkpoint", "directory"])
def test_loaded_weights_on_huge_pages_give_the_same_logits(tmp_path, monkeypatch, source):
    """Checkpoint loads and converted directories put the streamed weights (not the embedding,
    read by rows from a file) on huge pages; the logits are those of a load without them."""
    import torch

    import rwkv_engine
    from rwkv_engine import loading, testing
    from rwkv_engine.loading import converted

    if not _thp_in_use():
        pytest.skip("no transparent huge pages here")
    sd = testing.cast(
        testing.random_state_dict("7", n_layer=2, n_embd=1024, vocab_size=32768, head_size=64, seed=2), torch.bfloat16
    )
    path = testing.save_pth(sd, tmp_path / "m.pth")
    if source == "directory":
        path = converted.convert(loading.prepare(path, quantization="q8"), tmp_path / "q8", progress=False)

    def load():
        return rwkv_engine.load(path, progress=False, **({} if source == "directory" else {"dtype": "bf16"}))

    def big(model):
        return {n: t for n, t in model.state_dict().items() if t.numel() * t.element_size() >= 2 << 20}

    before = _rss_file_kb()
    model = load()
    moved = big(model)
    # the copied tensors' file pages were dropped: the mapping does not stay resident beside them
    # (a bf16 checkpoint's matrices are the mapped file itself until copied)
    copied_kb = sum(t.numel() * t.element_size() for n, t in moved.items() if not n.startswith("emb.")) // 1024
    assert _rss_file_kb() - before < copied_kb // 4, (_rss_file_kb() - before, copied_kb)
    assert moved and all(_on_huge_pages(t) for n, t in moved.items() if not n.startswith("emb.")), [
        n for n, t in moved.items() if not _on_huge_pages(t)
    ]
    assert model.emb.file_rows is not None and model.emb.file_rows.serves(model.emb.weight)
    # "private" (Ray replicas): a directory's weights stay in the shared file mapping; a
    # checkpoint's, the process's own anyway, still move
    monkeypatch.setenv("RWKV_ENGINE_HUGE_PAGES", "private")
    private = big(load())
    assert all(_on_huge_pages(t) != (source == "directory") for n, t in private.items() if not n.startswith("emb."))
    monkeypatch.setenv("RWKV_ENGINE_HUGE_PAGES", "0")
    plain = load()
    assert not any(_on_huge_pages(t) for t in big(plain).values())
    prompt = [1, 2, 3, 32767, 0, 9]
    a, sa = model.forward(prompt)
    b, sb = plain.forward(prompt)
    assert torch.equal(a, b)
    a, _ = model.forward([5], sa)
    b, _ = plain.forward([5], sb)
    assert torch.equal(a, b)
