"""Every Triton kernel a training step launches, compiled for an NVIDIA GPU on a machine without one: per kernel
its registers, spills, shared memory and what its dot products became (tensor-core or scalar instructions).

    python -m hybridtron.bench.compile_report                         # sm_90a (H100), the 1B presets, bf16
    python -m hybridtron.bench.compile_report --arch 90a 80 --presets hybrid_1b --append

How. Triton lowers a kernel to PTX and assembles it with the ptxas it ships, for any target, on any machine;
only loading a kernel needs the driver. This script installs a stand-in driver that reports the target,
turns every launch into a compile without a launch (autotuned kernels: every candidate config the pruner
keeps), and runs each preset's model forward + backward, then a short cached decode, on CPU tensors (torch's
own matrix products skipped too: ``_SkipProducts``). So the
kernels compiled are exactly those a training step launches, with the block sizes and flags the launchers
pick at the preset's widths. Nothing is computed: a skipped kernel's outputs stay uninitialised memory, and
only the host code between launches runs (on the CPU, at a short sequence; the kernels' compile-time
constants depend on widths, dtypes and flags, not on the sequence length).

Per compiled kernel (``cuobjdump`` on the cubin): registers per thread; the stack frame in bytes (where
ptxas puts spilled registers: > 0 means the kernel spills; our kernels keep no local arrays); shared memory in bytes (against the target's
per-block limit: over it, the launch would fail with "out of resources"); and counts of HGMMA (Hopper
warpgroup MMA), HMMA (tensor-core MMA), FFMA (scalar fp32 fused multiply-add) instructions in the SASS.
A kernel whose dot products run as FFMA does them on the CUDA cores, at a fraction of the tensor cores'
rate: that is what IEEE fp32 ``tl.dot`` compiles to.

Run it without TRITON_INTERPRET (the interpreter would run the kernels in Python instead). With
COMPILE_REPORT_DUMP=DIR in the environment every compiled kernel's PTX is also written to DIR (for
``ptxas -v`` or reading). It found, before
any GPU ran them, that the delta-rule kernels did not compile at all (a non-constexpr global), that three of
their backward kernels needed more shared memory than an H100 block has, and that their IEEE fp32 dot
products were scalar FMAs; bench/RESULTS.md has the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from hybridtron.atomic import write_text_atomic
from hybridtron.bench.report import RESULTS, append_results

PRESETS = ("dense_1b", "hybrid_1b", "hybrid_moe")
OPS = ("norm", "rotary", "swiglu", "attention", "cross_entropy", "conv", "moe", "delta_rule", "hax")
# Shared memory one block may use (bytes), per compute capability: the CUDA programming guide's table.
SHARED_LIMIT = {"90a": 232448, "90": 232448, "89": 101376, "86": 101376, "80": 166912}
OPCODES = ("HGMMA", "HMMA", "FFMA", "DFMA")
_SHORT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "float64": "fp64"}


@dataclass
class Kernel:
    name: str
    arch: str
    params: dict
    dtypes: str
    warps: int
    stages: int
    shared: int
    regs: int = -1
    local: int = -1
    ops: dict = field(default_factory=dict)
    seconds: float = 0.0
    used_by: set = field(default_factory=set)

    @property
    def over_shared(self) -> bool:
        return self.shared > SHARED_LIMIT.get(self.arch, 1 << 30)


class _StandInDriver:
    """What triton's JIT asks of the active driver before it compiles: the target and a device / stream id."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        # triton caches compiled kernels per device id; one id per target keeps two targets' kernels apart
        return self.target.arch

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def _bin(tool: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def _inspect(cubin: bytes) -> tuple[int, int, dict]:
    """(registers, local bytes, opcode counts) of a one-kernel cubin, remembered by the cubin's sha256 beside
    triton's own cache (disassembling takes seconds a kernel; triton has the cubins cached already)."""
    import hashlib

    from triton import knobs

    memo = Path(knobs.cache.dir, "hybridtron-inspect", hashlib.sha256(cubin).hexdigest() + ".json")
    try:
        regs, local, ops = json.loads(memo.read_text())
        if set(ops) == set(OPCODES):
            return regs, local, ops
    except (OSError, ValueError):
        pass
    regs, local, ops = _disassemble(cubin)
    with contextlib.suppress(OSError):  # a read-only cache only costs the next run the time
        memo.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(memo, json.dumps([regs, local, ops]))
    return regs, local, ops


def _disassemble(cubin: bytes) -> tuple[int, int, dict]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([_bin("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
        sass = subprocess.run([_bin("cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    local = int(re.search(r"STACK:(\d+)", res).group(1))
    ops = {op: len(re.findall(rf"\b{op}\b", sass)) for op in OPCODES}
    return regs, local, ops


def project_kernels() -> set[str]:
    """Names of every Triton kernel (a jitted or autotuned function named ``*_kernel``) in the project."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    return {name for m in _kernel_modules() for name, obj in vars(m).items()
            if name.endswith("_kernel") and isinstance(obj, (JITFunction, Autotuner))}


def _kernel_modules():
    import importlib

    names = [f"hybridtron.kernels.{op}.triton_kernels" for op in
             ("norm", "rotary", "swiglu", "gated_attention", "cross_entropy", "short_conv", "moe_permute",
              "moe_gemm")]
    names += ["hybridtron.kernels.gated_delta_rule.chunk_kernels", "hybridtron.kernels.gated_delta_rule.recurrent",
              "hybridtron.kernels.gated_attention.gate_kernels"]
    return [importlib.import_module(n) for n in names]


@contextlib.contextmanager
def compile_only(arch: str, sink: dict, label: list):
    """Within: every Triton launch compiles its kernel for ``arch`` (e.g. "90a") and returns without running.
    Compiled kernels are collected in ``sink`` (keyed by kernel hash); ``label[0]`` names the current case."""
    if os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on", "y"):
        raise RuntimeError("compile_report compiles for a GPU: run it without TRITON_INTERPRET")
    from triton.backends.compiler import GPUTarget
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from hybridtron.kernels import backend, rules, triton_utils

    cap = int(re.match(r"\d+", arch).group(0))
    target = GPUTarget("cuda", cap, 32)
    if arch.endswith("a"):  # sm_90a: triton picks the "a" variant itself for capability 90
        assert cap == 90, f"only 90a has an arch-specific variant here, not {arch}"
    jit_run, tune_run = JITFunction.run, Autotuner.run

    def run(self, *args, grid, warmup, **kwargs):
        t0 = time.perf_counter()
        compiled = jit_run(self, *args, grid=grid, warmup=True, **kwargs)
        key = (arch, compiled.hash)
        if key not in sink:
            md = compiled.metadata
            consts = {p.name for p in self.params if p.is_constexpr}
            params = {k: v for k, v in kwargs.items() if k in consts and isinstance(v, (int, bool))}
            dtypes = sorted({str(a.dtype).removeprefix("torch.") for a in (*args, *kwargs.values())
                             if isinstance(a, torch.Tensor) and a.is_floating_point()})
            sink[key] = Kernel(self.fn.__name__, arch, params, "/".join(_SHORT.get(d, d) for d in dtypes),
                               md.num_warps, md.num_stages, md.shared, seconds=time.perf_counter() - t0)
            sink[key].regs, sink[key].local, sink[key].ops = _inspect(compiled.asm["cubin"])
            if os.environ.get("COMPILE_REPORT_DUMP"):
                Path(os.environ["COMPILE_REPORT_DUMP"], f"{self.fn.__name__}-{compiled.hash[:8]}.ptx").write_text(
                    compiled.asm["ptx"])
        sink[key].used_by.add(label[0])
        return compiled

    def tune(self, *args, **kwargs):  # every config the pruner keeps is a candidate the GPU would try
        kwargs.pop("warmup", None)
        grid = kwargs.pop("grid")
        self.nargs = dict(zip(self.arg_names, args, strict=False))
        try:
            for config in self.prune_configs(kwargs):
                self.fn.run(*args, grid=grid, warmup=True, **kwargs, **config.all_kwargs())
        finally:
            self.nargs = None

    patched = [(m, "check_interpreted") for m in _kernel_modules() if hasattr(m, "check_interpreted")]
    saved = [(m, n, getattr(m, n)) for m, n in patched]
    saved += [(backend, n, getattr(backend, n)) for n in ("triton_unavailable_reason", "check_interpreted")]
    saved += [(rules, "triton_unavailable_reason", rules.triton_unavailable_reason)]  # where resolve asks it
    saved += [(triton_utils, "interpreted", triton_utils.interpreted)]
    previous = driver._active  # None until a real driver was looked up (none exists without a GPU)
    driver.set_active(_StandInDriver(target))
    JITFunction.run, Autotuner.run = run, tune
    try:
        for m, n in patched:
            setattr(m, n, lambda *a, **k: None)
        backend.check_interpreted = lambda *a, **k: None
        backend.triton_unavailable_reason = lambda device=None, **_: None  # the switch picks triton for CPU tensors
        rules.triton_unavailable_reason = backend.triton_unavailable_reason
        triton_utils.interpreted = lambda device: False  # and the launchers choose as on the GPU
        yield
    finally:
        JITFunction.run, Autotuner.run = jit_run, tune_run
        driver._active = previous
        for m, n, v in saved:
            setattr(m, n, v)


def _model(preset: str, overrides: list[tuple[str, str]]):
    from hybridtron.configs import load_config
    from hybridtron.model import GatedLM

    cfg = load_config(preset, overrides)
    for op in OPS:
        setattr(cfg.model.kernels, op, "triton")
    vocab = cfg.model.resolve_vocab(cfg.data.tokenizer.vocab_size)
    with torch.device("meta"):
        model = GatedLM(cfg.model, vocab)
    model = model.to_empty(device="cpu")  # uninitialised weights: nothing is computed with them
    return cfg, model, vocab


class _SkipProducts(TorchDispatchMode):
    """The torch matrix products between the kernels return uninitialised tensors of their shape instead of
    computing: the weights are uninitialised, so nothing depends on their values, and bf16 products on a CPU
    without bf16 BLAS run a scalar loop (minutes for a 1B preset's output layer and its backward)."""

    PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_grouped_mm",
                "_scaled_dot_product_flash_attention_for_cpu"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "aten":  # our custom ops: their Python implementation, with this mode active, so the
            from torch._library.custom_ops import OPDEFS  # products inside are skipped too (and no op recurses)

            with self:
                return OPDEFS[func._name]._init_fn(*args, **kwargs)
        name = func._schema.name.removeprefix("aten::")
        if name.endswith("_") and name[:-1] in self.PRODUCTS:  # in place (addmm_): the target, left as it is
            return args[0]
        if name not in self.PRODUCTS:
            return func(*args, **kwargs)
        meta = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        shapes = func(*meta[0], **meta[1])
        return tree_map_only(torch.Tensor, lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype), shapes)


def run_preset(preset: str, seq: int = 128, decode: int = 2) -> None:
    """A training step (bf16 autocast, as on the GPU) and a short cached decode of ``preset``, at 4 layers."""
    layers = 4 if preset != "dense_1b" else 2
    cfg, model, vocab = _model(preset, [("model.n_layers", str(layers)), ("model.max_seq_len", str(seq + decode)),
                                        ("data.seq_len", str(seq))])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, seq), generator=g)
    docs = torch.cumsum(torch.rand(1, seq, generator=g) < 0.02, 1) if cfg.model.doc_mask else None
    with torch.autocast("cpu", dtype=torch.bfloat16), _SkipProducts():
        model(ids, docs, labels=torch.roll(ids, -1, 1)).backward()
        from hybridtron.model.attention import GatedAttention
        from hybridtron.model.moe import MoE

        moe = next((m for m in model.modules() if isinstance(m, MoE)), None)
        if moe is not None:  # model.moe.gather=gemm is no preset's choice: compile its grouped GEMMs at these widths
            moe.gather = "gemm"
            moe(torch.randn(seq, cfg.model.d_model, requires_grad=True)).sum().backward()
        attn = next((m for m in model.modules() if isinstance(m, GatedAttention)), None)
        if attn is not None:  # the output gate after a peer's attention (sdpa, flex, flash-attn: auto's choices)
            from hybridtron.kernels.gated_attention.gate import sigmoid_gate

            H, D = attn.n_heads, attn.head_dim
            a = torch.randn(1, seq, H, D, dtype=torch.bfloat16, requires_grad=True)
            for shape in ((1, seq, H, D), (1, seq, H)):
                sigmoid_gate(a, torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)).sum().backward()
        with torch.no_grad():
            cache = model.new_cache()
            model(ids[:, :8], cache=cache)
            for t in range(decode):
                model(ids[:, 8 + t:9 + t], cache=cache)


def run_attention_variants(dtype: torch.dtype = torch.bfloat16) -> None:
    """Gated attention beyond the presets: head dims 64 and 256 (the issue's targets), the per-head gate and
    no gate, fp32 inputs (IEEE dots)."""
    from hybridtron.kernels.gated_attention import gated_attention

    for D, gate, dt in ((64, "elem", dtype), (256, "elem", dtype), (128, "head", dtype), (128, None, dtype),
                        (128, "elem", torch.float32)):
        T, H, KV = 128, 4, 2
        q, k, v = (torch.empty(1, T, n, D, dtype=dt, requires_grad=True) for n in (H, KV, KV))
        shape = (1, T, H, D) if gate == "elem" else (1, T, H)
        gt = None if gate is None else torch.empty(shape, dtype=dt, requires_grad=True)
        docs = torch.cumsum(torch.rand(1, T) < 0.05, 1)
        out = gated_attention(q, k, v, gt, doc_ids=docs, backend="triton")
        out.backward(torch.empty_like(out))


def report(kernels: list[Kernel]) -> str:
    """A Markdown table, one row per distinct compiled kernel (variants that differ only in how triton
    specialised integer arguments, e.g. a stride divisible by 16, are merged and counted)."""
    rows: dict[tuple, list] = {}
    for k in kernels:
        params = " ".join(f"{n}={int(v)}" for n, v in sorted(k.params.items()))
        key = (k.name, k.arch, k.dtypes, params, k.warps, k.stages)
        cells = (k.regs, k.local, k.shared, k.over_shared, k.ops["HGMMA"], k.ops["HMMA"], k.ops["FFMA"])
        row = rows.setdefault(key, [[], set(), 0])
        row[0].append(cells)
        row[1] |= k.used_by
        row[2] += 1
    lines = ["| kernel | arch | float args | constexprs | warps | stages | variants | regs | stack B (spills) | "
             "shared B | HGMMA | HMMA | FFMA | run by |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for key in sorted(rows, key=lambda r: (r[0], r[1], r[2], r[3], r[4], r[5])):
        name, arch, dtypes, params, warps, stages = key
        cells, used_by, n = rows[key]
        worst = max(cells, key=lambda c: (c[3], c[1], c[0]))  # the variant closest to a limit
        regs, stack, shared, over, hgmma, hmma, ffma = worst
        lines.append(f"| {name} | sm_{arch} | {dtypes} | {params} | {warps} | {stages} | {n} | {regs} | {stack} | "
                     f"{shared}{' **over**' if over else ''} | {hgmma} | {hmma} | {ffma} | "
                     f"{', '.join(sorted(used_by))} |")
    return "\n".join(lines)


def summary(kernels: list[Kernel]) -> list[str]:
    out = [f"- {len(kernels)} compiled kernels ({len({k.name for k in kernels})} distinct), "
           f"{sum(k.seconds for k in kernels):.0f} s of compiling"]
    spills = sorted({(k.name, k.arch) for k in kernels if k.local > 0})
    out.append("- spilling (stack > 0): " + (", ".join(f"{n} (sm_{a})" for n, a in spills) or "none"))
    over = sorted({(k.name, k.arch) for k in kernels if k.over_shared})
    out.append("- over the shared-memory limit: " + (", ".join(f"{n} (sm_{a})" for n, a in over) or "none"))
    return out


def main(argv: list[str] | None = None) -> list[Kernel]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", default=["90a"], help="compute capabilities: 90a (H100), 80 (A100), ...")
    ap.add_argument("--presets", nargs="*", default=list(PRESETS))
    ap.add_argument("--no-attention-variants", dest="variants", action="store_false")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--append", action="store_true", help="append the table to bench/RESULTS.md")
    ap.add_argument("--json", help="also write every compiled kernel's figures to this file")
    args = ap.parse_args(argv)
    import triton

    sink: dict = {}
    label = [""]
    for arch in args.arch:
        with compile_only(arch, sink, label):
            for preset in args.presets:
                label[0] = preset
                run_preset(preset, args.seq)
            if args.variants:
                label[0] = "attention variants"
                run_attention_variants()
    kernels = list(sink.values())
    body = report(kernels) + "\n\n" + "\n".join(summary(kernels))
    print(body)
    if args.json:
        Path(args.json).write_text(json.dumps([dict(vars(k), used_by=sorted(k.used_by), over_shared=k.over_shared)
                                               for k in kernels], indent=1))
    if args.append:
        cmd = "python -m hybridtron.bench.compile_report " + " ".join(argv if argv is not None else [])
        append_results(RESULTS, f"Kernels compiled for {', '.join('sm_' + a for a in args.arch)} without a GPU "
                       f"({time.strftime('%Y-%m-%d')}, triton {triton.__version__}, torch {torch.__version__})",
                       cmd.strip(), body)
    return kernels


if __name__ == "__main__":
    main()
