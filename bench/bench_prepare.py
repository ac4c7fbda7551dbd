"""``prepare`` with data.workers processes, side by side in one run (issue 41's benchmark).

    python -m hybridtron.bench.bench_prepare [--max-files 0] [--repeats 3] [--part-mb 4]

The corpus is this interpreter's stdlib Python files (nothing is downloaded); the tokenizer (BPE, ``--vocab``) is
trained once, outside the timed region, and every side uses it. Sides, alternated over ``--repeats``, the median
reported:

- ``workers=1``: one process, one tokenizer thread (one core);
- ``workers=N``: N processes (``--workers``, default the cores), one tokenizer thread each;
- ``encode_batch``: plain ``tokenizers`` on the same documents already in memory, all threads: the ceiling.

It also prints what the reader costs per MB (one pass of the source stream, no tokenizing) and what the parent of
a parallel prepare costs (its own CPU seconds: taking the parts' tokens in order, splitting, writing and
checksumming the shards), from which it predicts a 64-core node's and 100 nodes' throughput (labelled a
prediction).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from hybridtron.configs.job import DataConfig, SourceConfig, TokenizerConfig
from hybridtron.data_pipeline import prepare_data
from hybridtron.data_pipeline.sources import iter_documents

_PREPARE = """
from hybridtron.data_pipeline import prepare_data
import hybridtron.data_pipeline.parts, hybridtron.data_pipeline.prepare, datasets, tokenizers
start()
prep = prepare_data(cfg, log=lambda *a: None)
result["tokens"] = prep.stats["train"]["tokens"] + prep.stats["val"]["tokens"]
"""
# plain tokenizers on the documents prepare keeps, read before the clock starts
_ENCODE = """
from tokenizers import Tokenizer
from hybridtron.data_pipeline.sources import iter_documents
texts = [t for b in iter_documents(cfg.sources[0], True, Path(cfg.out_dir) / "cache") for t in b]
hf = Tokenizer.from_file(cfg.tokenizer.path)
start()
hf.encode_batch(texts, add_special_tokens=False)
"""
_READ = """
from hybridtron.data_pipeline.sources import SourceStream
import datasets
start()
for _ in SourceStream(cfg.sources[0], cfg, Path(cfg.out_dir) / "cache"):
    pass
"""


def _in_process(body: str, cfg: DataConfig, threads: int) -> dict:
    """Run ``body`` in a fresh Python with ``cfg`` and RAYON_NUM_THREADS=threads; its wall and CPU seconds (its own
    process's, not its children's) from ``start()`` (or the beginning) to the end."""
    import json
    import pickle
    import subprocess
    import sys

    code = ("import json, pickle, sys, time\nfrom pathlib import Path\ncfg = pickle.loads(bytes.fromhex(sys.argv[1]))\n"
            "result = {}\nt = [time.perf_counter(), time.process_time()]\n"
            "def start():\n    t[:] = [time.perf_counter(), time.process_time()]\n" + body +
            "\nresult.update(wall=time.perf_counter() - t[0], cpu=time.process_time() - t[1])\n"
            "print('RESULT ' + json.dumps(result))\n")
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads)}
    p = subprocess.run([sys.executable, "-c", code, pickle.dumps(cfg).hex()], env=env, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        raise RuntimeError(f"bench_prepare: a side failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(lines[-1][7:])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-files", type=int, default=0, help="stdlib files (0 = all)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--part-mb", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench_prepare_"))
    try:
        source = SourceConfig(path="stdlib", max_files=args.max_files)
        base = dict(sources=[source], tokenizer=TokenizerConfig(kind="bpe", vocab_size=args.vocab,
                                                                   sample_mb=5.0), part_mb=args.part_mb)
        tok_dir = prepare_data(DataConfig(**base, out_dir=str(work / "tok")), log=lambda *a: None).tokenizer_dir
        pretrained = TokenizerConfig(kind="pretrained", path=str(tok_dir / "tokenizer.json"))
        texts = [t for batch in iter_documents(source, True, work / "cache") for t in batch]
        mb = sum(len(t.encode()) for t in texts) / 1e6
        del texts[1:]

        sides: dict[int, list[float]] = {1: [], args.workers: []}
        parent_cpu: list[float] = []
        raw: list[float] = []
        read: list[float] = []
        n_tok = 0
        for r in range(args.repeats):  # each side in a fresh process: Rayon's thread count is fixed per process
            for w in sides:
                out = work / f"w{w}-{r}"
                cfg = DataConfig(**{**base, "tokenizer": pretrained}, out_dir=str(out), workers=w, num_workers=1)
                got = _in_process(_PREPARE, cfg, threads=1)
                sides[w].append(got["wall"])
                if w > 1:
                    parent_cpu.append(got["cpu"])
                n_tok = got["tokens"]
                shutil.rmtree(out)
            cfg = DataConfig(**{**base, "tokenizer": pretrained}, out_dir=str(work / "tok"))
            raw.append(_in_process(_ENCODE, cfg, threads=os.cpu_count() or 1)["wall"])
            read.append(_in_process(_READ, cfg, threads=1)["cpu"])
        read_cpu = statistics.median(read)
        med = {w: statistics.median(t) for w, t in sides.items()}
        t_raw = statistics.median(raw)
        print(f"\ncorpus: stdlib files, {mb:.1f} MB, {n_tok:,} tokens, BPE vocab {args.vocab}, "
              f"{os.cpu_count()} cores, part_mb {args.part_mb:g}, {args.repeats} alternating repeats (median)")
        print("| side | s | MB/s | Mtok/s |\n| --- | ---: | ---: | ---: |")
        for w, t in med.items():
            print(f"| prepare, workers={w} x 1 thread | {t:.2f} | {mb / t:.2f} | {n_tok / t / 1e6:.3f} |")
        print(f"| tokenizers encode_batch, in memory, all threads | {t_raw:.2f} | {mb / t_raw:.2f} | "
              f"{n_tok / t_raw / 1e6:.3f} |")
        print(f"workers={args.workers} / workers=1: {med[1] / med[args.workers]:.2f}x (target >= 1.7x on 2 cores); "
              f"workers={args.workers} / encode_batch: {t_raw / med[args.workers]:.0%} (target >= 90%)")
        per_core = mb / med[1]
        parent = statistics.median(parent_cpu) / mb
        print(f"reader: {mb / read_cpu:.1f} MB per CPU-second; parent of a parallel prepare: {parent * 1e3:.1f} "
              f"CPU-ms per MB ({1 / parent:.0f} MB/s on its one core); one worker: {per_core:.2f} MB/s")
        node = min(64 * per_core, 1 / parent)
        print(f"PREDICTION (arithmetic on these figures, not measured): a 64-core node ~{node:.0f} MB/s "
              f"({'its parent bounds it' if node < 64 * per_core else 'the cores bound it'}); 100 such nodes as "
              f"array tasks: tokenizing ~{100 * 64 * per_core:.0f} MB/s, then merging at ~{1 / parent:.0f} MB/s "
              f"per source on one node")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
