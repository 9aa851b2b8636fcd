"""Make flash-linear-attention's Triton kernels run under Triton's CPU interpreter (tests only).

`install()` must run in a process with TRITON_INTERPRET=1 set before triton was imported; call it
after importing the fla modules to be tested. It patches three things the interpreter cannot
handle in fla 0.6.0, none of which changes what a kernel computes:

1. Autotuned kernels benchmark their configs on a GPU driver ("0 active drivers"): every
   autotuner keeps its first config (any config computes the same result, by autotune's contract).
2. Module-level aliases of Triton builtins (`gather = tl.gather` in fla/ops/utils/op.py) escape the
   interpreter's patching of `tl`: they are replaced by functions that look the builtin up in `tl`
   when called, i.e. the interpreter's version while a kernel runs.
3. Loop variables of `range` / `tl.range` loops are Python ints in the interpreter but int32
   tensors when compiled, and fla calls `i_t.to(tl.int64)` on them: such loops yield tensors.
   (`tl.static_range` loops stay ints: compiled, their variables are constexprs.)
"""

from __future__ import annotations

import ast
import sys

_installed = False


def _patch_autotuner() -> None:
    from triton.runtime import autotuner

    original = autotuner.Autotuner.prune_configs

    def first_config(self, kwargs):
        return original(self, kwargs)[:1]

    autotuner.Autotuner.prune_configs = first_config


def _forwarder(path: tuple[str, ...]):
    import triton.language as tl

    def call(*args, **kwargs):
        obj = tl
        for name in path:
            obj = getattr(obj, name)
        return obj(*args, **kwargs)

    return call


def _patch_builtin_aliases() -> None:
    import triton.language as tl

    builtins = {}
    for prefix, space in (((), tl), (("math",), tl.math)):
        for name, obj in vars(space).items():
            if callable(obj) and getattr(obj, "__triton_builtin__", False):
                builtins.setdefault(id(obj), (*prefix, name))
    for modname, module in list(sys.modules.items()):
        if module is None or not (modname == "fla" or modname.startswith("fla.")):
            continue
        for name, obj in list(vars(module).items()):
            path = builtins.get(id(obj))
            if path is not None:
                setattr(module, name, _forwarder(path))


def _tensor_loop(iterable):
    from triton.runtime.interpreter import interpreter_semantic

    for i in iterable:
        yield interpreter_semantic.to_tensor(i, False) if isinstance(i, int) else i


class _TensorLoops(ast.NodeTransformer):
    """`for i in range(...)` / `for i in tl.range(...)` -> `for i in _gk_tensor_loop(range(...))`."""

    def visit_For(self, node):
        node = self.generic_visit(node)
        it = node.iter
        if isinstance(it, ast.Call):
            f = it.func
            plain = isinstance(f, ast.Name) and f.id == "range"
            dynamic = isinstance(f, ast.Attribute) and f.attr == "range"
            if plain or dynamic:
                node.iter = ast.Call(func=ast.Name(id="_gk_tensor_loop", ctx=ast.Load()), args=[it], keywords=[])
        return node


def _patch_loop_variables() -> None:
    from triton.runtime import interpreter

    base = interpreter.FunctionRewriter.ast_transformer
    loops = _TensorLoops()

    class Transformer(type(base)):
        def visit(self, node):
            return type(base).visit(self, loops.visit(node)) if isinstance(node, ast.Module) else super().visit(node)

    interpreter.FunctionRewriter.ast_transformer = Transformer()
    interpreter._gk_tensor_loop = _tensor_loop  # the rewriter copies the interpreter's globals into the kernel's


def install() -> None:
    """Apply the three patches (once per process; aliases are re-scanned on every call)."""
    import os

    global _installed
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("gpu_interpreter.install() needs TRITON_INTERPRET=1 set before triton is imported")
    if not _installed:
        _patch_autotuner()
        _patch_loop_variables()
        _installed = True
    _patch_builtin_aliases()


# ---- the cases, run in a subprocess by tests/test_gpu_kernels.py ----------------------------------
# One process runs them all (importing fla costs 7-12 s); each prints one JSON line of relative RMS
# errors against the naive recurrences computed in fp64 on the same (dtype-rounded) inputs.

_DTYPES = {"fp32": "float32", "fp16": "float16"}


def _inputs(case: dict):
    import math

    import torch
    import torch.nn.functional as F

    B, T, H, K = case["B"], case["T"], case["H"], case["K"]
    dt = getattr(torch, _DTYPES[case["dtype"]])
    g = torch.Generator().manual_seed(case["seed"])

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    if case["kernel"].endswith("7"):
        r, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, K)
        log_w = -math.exp(-0.5) * torch.sigmoid(2 * randn(B, T, H, K))  # RWKV-7's range
        kk = F.normalize(randn(B, T, H, K), dim=-1)
        iclr = torch.rand(B, T, H, K, generator=g)
        args = [r, k, v, log_w, -kk, kk * iclr]
    else:
        r, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, K)
        # RWKV-6's w = exp(-exp(x)): per-token decays from ~1 down to ~exp(-10)
        log_w = -torch.exp(randn(H, K) - 1) if case.get("const") else -torch.exp(randn(B, T, H, K) - 1)
        args = [r, k, v, log_w, randn(H, K)]
    args = [x.to(dt) for x in args]
    state = 0.5 * randn(B, H, K, K)
    if case.get("strided"):  # views with batch / head strides of a wider tensor (unit last stride),
        # the state as a layer's slice [:, 1] of a [B, L, H, K, V] model state
        args = [torch.cat([x, torch.zeros_like(x)], dim=-1)[..., :K] if x.dim() == 4 else x for x in args]
        state = torch.stack([torch.zeros_like(state), state], dim=1)[:, 1]
    return args, state


def _run_model(case: dict) -> dict:
    """A tiny random model (B rows: a 5-token prefill, then 2 decode steps) with its WKV calls routed
    through the CUDA dispatch (gpu.wkv7_cuda / wkv5_cuda) against the same model on its CPU path:
    the kernels take the tensors the models really pass (views, layer slices of the state)."""
    import tempfile

    import torch

    import rwkv_engine
    from rwkv_engine import testing
    from rwkv_engine.kernels import gpu
    from rwkv_engine.models import rwkv5, rwkv6, rwkv7

    sd = testing.random_state_dict(case["version"], n_layer=2, n_embd=32, vocab_size=300, head_size=16, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        model = rwkv_engine.load(testing.save_pth(sd, f"{tmp}/m.pth"), progress=False)
    model.native_decode = False  # one-token steps through the modules, as on CUDA
    ids = torch.randint(0, 300, (case["B"], 7), generator=torch.Generator().manual_seed(0))

    def run():
        logits, state = model.forward(ids[:, :5])
        out = [logits]
        for t in (5, 6):
            logits, state = model.forward(ids[:, t : t + 1], state)
            out.append(logits)
        return torch.stack(out)

    ref = run()
    gpu.fla.available = lambda: True
    calls = []

    def via7(*args):
        calls.append(args[0].shape[1])
        return gpu.wkv7_cuda(*args)

    def via5(*args):
        calls.append(args[0].shape[1])
        return gpu.wkv5_cuda(*args)

    rwkv7.wkv7, rwkv5.wkv5, rwkv6.wkv5 = via7, via5, via5
    got = run()
    return {"logits": testing.rel_rms(got.double(), ref.double()), "calls": sorted(set(calls))}


def _run(case: dict) -> dict:
    import torch

    if case["kernel"] == "model":
        return _run_model(case)

    from rwkv_engine import kernels
    from rwkv_engine.kernels import gpu
    from rwkv_engine.testing import rel_rms

    args, state = _inputs(case)
    before = [x.clone() for x in args] + [state.clone()]
    naive = kernels.wkv7_naive if case["kernel"].endswith("7") else kernels.wkv5_naive
    y_ref, s_ref = naive(*(x.double() for x in args), state.double())
    kernel = case["kernel"]
    if kernel in ("step7", "step5"):
        fn = gpu.step.wkv7_step if kernel == "step7" else gpu.step.wkv5_step
        if case.get("inplace"):  # the CUDA-graph form: preallocated y, the state updated in place
            B, _, H, _ = args[0].shape
            s = torch.stack([torch.zeros_like(state), state], dim=1)[:, 1] if case.get("strided") else state.clone()
            y = torch.full((B, 1, H, args[2].shape[-1]), float("nan"), dtype=args[0].dtype)
            y2, s2 = fn(*args, s, out=y, state_out=s)
            assert y2 is y and s2 is s
        else:
            y, s = fn(*args, state)
    elif kernel == "fla7":
        y, s = gpu.fla.wkv7_fla(*args, state, chunk_size=case.get("chunk", 16))
    elif kernel == "fla6":
        y, s = gpu.fla.wkv6_fla(*args, state)
    elif kernel in ("cuda7", "cuda5"):  # the dispatch, as if on CUDA with fla installed
        gpu.fla.available = lambda: True
        y, s = (gpu.wkv7_cuda if kernel == "cuda7" else gpu.wkv5_cuda)(*args, state)
    else:
        raise ValueError(kernel)
    unchanged = all(torch.equal(x, x0) for x, x0 in zip(args + [state], before))
    return {
        "y": rel_rms(y.double(), y_ref),
        "state": rel_rms(s.double(), s_ref),
        "y_dtype": str(y.dtype).removeprefix("torch."),
        "state_dtype": str(s.dtype).removeprefix("torch."),
        "inputs_unchanged": unchanged,
    }


def main() -> None:
    import json
    import time
    import warnings

    cases = json.loads(sys.argv[1])
    warnings.filterwarnings("ignore")  # fla's "Triton is not supported on current platform" on CPU
    from rwkv_engine.kernels.gpu import fla

    if not fla.importable():
        raise SystemExit("fla / triton not importable")
    fla._ops()
    install()
    for case in cases:
        t = time.perf_counter()
        try:
            out = _run(case)
        except Exception as e:  # reported per case; the test shows it
            out = {"error": f"{type(e).__name__}: {e}"[:2000]}
        out["seconds"] = round(time.perf_counter() - t, 2)
        print("CASE " + json.dumps({"id": case["id"], **out}), flush=True)


if __name__ == "__main__":
    main()
