"""Data pipeline throughput, measured side by side in one run.

1. ``prepare`` (read with HF datasets -> split -> tokenize -> write + checksum shards) against plain
   ``tokenizers.encode_batch`` of the same texts, already in memory, with the same tokenizer and cores.
2. The loader: samples/s and tokens/s of iterating ``build_loader`` at the tiny preset's batch shape,
   against the tokens/s of a tiny-preset training step (forward, backward, AdamW) on the same batches.

    python -m hybridtron.bench.bench_data [--max-files 600] [--vocab 4096] [--steps 2000] [--train-steps 30]
    python -m hybridtron.bench.bench_data --corpus mixed [--mixed-mb 50]

Corpora: ``stdlib`` (Python source files of this interpreter) or ``mixed``: a multilingual corpus built
from the translated messages of the gettext catalogs (``*.mo``) installed on this machine, one document
per catalog, in a seeded shuffle of languages and programs, cut at ``--mixed-mb`` megabytes. Nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import struct
import tempfile
import time
from pathlib import Path

from hybridtron.configs.job import DataConfig, SourceConfig, TokenizerConfig, load_config
from hybridtron.data_pipeline import build_dataset, build_loader, prepare_data
from hybridtron.data_pipeline.sources import iter_documents

MO_ROOTS = ("/usr/share/locale", "/usr/lib")


def mo_messages(data: bytes) -> list[bytes]:
    """The translated strings of a GNU gettext ``.mo`` catalog (header entry excluded, plural forms split)."""
    order = {0x950412DE: "<", 0xDE120495: ">"}.get(struct.unpack("<I", data[:4])[0])
    if order is None:
        raise ValueError("not a .mo file")
    _rev, n, _orig, trans = struct.unpack(order + "4I", data[4:20])
    out = []
    for i in range(1, n):  # entry 0 is the catalog's metadata header
        length, off = struct.unpack(order + "2I", data[trans + 8 * i: trans + 8 * i + 8])
        out.extend(m for m in data[off: off + length].split(b"\0") if m)
    return out


def write_mixed_corpus(dest: Path, target_mb: float, seed: int = 0) -> tuple[int, int]:
    """Write one .txt document per installed gettext catalog (its translations, one per line) into ``dest``,
    catalogs in a seeded shuffle, until ``target_mb`` MB; returns (documents, languages)."""
    catalogs = sorted(p for root in MO_ROOTS if Path(root).is_dir() for p in Path(root).rglob("*.mo"))
    random.Random(seed).shuffle(catalogs)
    dest.mkdir(parents=True, exist_ok=True)
    size, docs, langs = 0, 0, set()
    for mo in catalogs:
        try:
            text = "\n".join(m.decode("utf-8") for m in mo_messages(mo.read_bytes()))
        except (ValueError, struct.error, UnicodeDecodeError, OSError):
            continue  # another encoding than UTF-8, or not a catalog
        if not text.strip():
            continue
        lang = mo.parts[mo.parts.index("LC_MESSAGES") - 1] if "LC_MESSAGES" in mo.parts else "?"
        (dest / f"{docs:05d}_{lang}_{mo.stem}.txt").write_text(text + "\n", encoding="utf-8")
        size, docs = size + len(text.encode()) + 1, docs + 1
        langs.add(lang)
        if size >= target_mb * 1e6:
            break
    if size < target_mb * 1e6:
        print(f"note: the gettext catalogs on this machine hold only {size / 1e6:.1f} MB of UTF-8 translations")
    return docs, len(langs)


def _row(name: str, seconds: float, mb: float, tokens: int) -> str:
    return f"| {name:<34} | {seconds:8.2f} | {mb / seconds:8.2f} | {tokens / seconds / 1e6:9.3f} |"


def _train_step_tokens_per_s(job, tokenizer_vocab: int, loader, steps: int) -> float:
    """tokens/s of the tiny preset's optimizer step (fp32, this machine's cores), loader time excluded."""
    import torch

    from hybridtron.model import GatedLM
    from hybridtron.train.optim import build_optimizer

    torch.manual_seed(0)
    model = GatedLM(job.model, job.model.resolve_vocab(tokenizer_vocab))
    model.init_weights()
    opt = build_optimizer(model, job.train)
    batches = [next(loader) for _ in range(steps + 3)]
    elapsed, tokens = 0.0, 0
    for i, b in enumerate(batches):
        t0 = time.perf_counter()
        model(b["input_ids"], labels=b["labels"]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 3:  # the first steps allocate optimizer state and warm the allocator
            elapsed += time.perf_counter() - t0
            tokens += b["input_ids"].numel()
    return tokens / elapsed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", choices=["stdlib", "mixed"], default="stdlib")
    ap.add_argument("--max-files", type=int, default=600, help="stdlib files (0 = all)")
    ap.add_argument("--mixed-mb", type=float, default=50.0, help="size of the mixed-language corpus")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2000, help="loader micro-batches to time")
    ap.add_argument("--repeats", type=int, default=5, help="alternating timings of each side")
    ap.add_argument("--train-steps", type=int, default=30, help="tiny-preset training steps to time")
    ap.add_argument("--no-streaming", dest="streaming", action="store_false", help="materialise an Arrow cache first")
    args = ap.parse_args(argv)

    tiny = load_config("tiny")
    work = Path(tempfile.mkdtemp(prefix="bench_data_"))
    try:
        if args.corpus == "mixed":
            n_docs, n_langs = write_mixed_corpus(work / "corpus", args.mixed_mb)
            source = SourceConfig(path=str(work / "corpus"))
            what = f"gettext catalogs ({n_langs} languages)"
        else:
            source, what = SourceConfig(path="stdlib", max_files=args.max_files), "stdlib files"
        cfg = DataConfig(
            sources=[source],
            tokenizer=TokenizerConfig(kind="bpe", vocab_size=args.vocab, sample_mb=5.0),
            out_dir=str(work / "out"),
            seq_len=tiny.data.seq_len,
            streaming=args.streaming,
        )
        # the tokenizer is trained outside the timed region: both sides then use the same one
        tmp_cfg = DataConfig(**{**cfg.__dict__, "out_dir": str(work / "tok")})
        tok_dir = prepare_data(tmp_cfg, log=lambda *a: None).tokenizer_dir

        # The documents prepare keeps (binary and invalid-UTF-8 files skipped by its policy), read untimed.
        texts = [t for batch in iter_documents(cfg.sources[0], True, work / "cache") for t in batch]
        mb = sum(len(t.encode()) for t in texts) / 1e6

        # Each side gets a freshly loaded tokenizer: the BPE word cache makes a second pass over the same text
        # ~20% faster, so reusing prepare's tokenizer object would flatter the baseline. Sides alternate over
        # repeats and the median is reported.
        from tokenizers import Tokenizer as HFTokenizer

        t_preps, t_raws, c_preps, c_raws = [], [], [], []
        for r in range(args.repeats):
            out_r = work / f"out{r}"
            shutil.copytree(tok_dir, out_r / "tokenizer")
            cfg_r = DataConfig(**{**cfg.__dict__, "out_dir": str(out_r)})
            t0, c0 = time.perf_counter(), time.process_time()
            prep = prepare_data(cfg_r, log=lambda *a: None)
            t_preps.append(time.perf_counter() - t0)
            c_preps.append(time.process_time() - c0)
            n_tok = prep.stats["train"]["tokens"] + prep.stats["val"]["tokens"]

            hf = HFTokenizer.from_file(str(tok_dir / "tokenizer.json"))  # plain tokenizers, no wrapper of ours
            t0, c0 = time.perf_counter(), time.process_time()
            enc = hf.encode_batch(texts, add_special_tokens=False)
            t_raws.append(time.perf_counter() - t0)
            c_raws.append(time.process_time() - c0)
            n_raw = sum(len(e.ids) for e in enc) + len(enc)  # + one EOS per document, as prepare stores
            del enc, hf  # millions of Encoding objects: kept alive, they slowed the next prepare by up to 2x
            assert n_raw == n_tok, f"token counts differ: prepare {n_tok}, encode_batch {n_raw}"
        t_prep, t_raw = statistics.median(t_preps), statistics.median(t_raws)
        cfg = cfg_r

        print(f"\ncorpus: {len(texts)} {what}, {mb:.1f} MB, {n_tok:,} tokens, BPE vocab {args.vocab}")
        print("| stage                              |      s   |   MB/s   | Mtok/s    |")
        print("|------------------------------------|----------|----------|-----------|")
        print(_row("prepare (read+tokenize+write)", t_prep, mb, n_tok))
        print(_row("tokenizers encode_batch (in memory)", t_raw, mb, n_raw))
        # This VM's timings swing +-30% run to run; the best of alternating repeats is the least noisy estimate.
        print(f"prepare / encode_batch throughput: best {min(t_raws) / min(t_preps):.0%}, median {t_raw / t_prep:.0%}"
              f"  (target >= 90%; {args.repeats} alternating repeats: prepare {[round(x, 2) for x in t_preps]} s, "
              f"encode_batch {[round(x, 2) for x in t_raws]} s)")
        # CPU seconds of the whole process (all threads, Rust's included) swing less than wall time on a shared VM.
        print(f"CPU seconds, median: prepare {statistics.median(c_preps):.2f}, encode_batch "
              f"{statistics.median(c_raws):.2f}; encode_batch / prepare CPU time "
              f"{statistics.median(c_raws) / statistics.median(c_preps):.0%}")

        ds = build_dataset(cfg, "train")
        micro = tiny.train.micro_batch_size
        loader = build_loader(ds, micro, tiny.train.grad_accum_steps, seed=0)
        for _ in range(10):
            next(loader)  # warm the page cache and the first epoch's permutation
        t0 = time.perf_counter()
        for _ in range(args.steps):
            next(loader)
        t_load = time.perf_counter() - t0
        n_samples = args.steps * micro
        print(
            f"\nloader: {n_samples / t_load:,.0f} samples/s, {n_samples * cfg.seq_len / t_load:,.0f} tokens/s "
            f"(micro_batch {micro} x seq_len {cfg.seq_len}, {len(ds)} train samples)"
        )
        step_tok_s = _train_step_tokens_per_s(tiny, prep.tokenizer.vocab_size, loader, args.train_steps)
        print(f"tiny-preset train step: {step_tok_s:,.0f} tokens/s on this machine; "
              f"loader headroom {n_samples * cfg.seq_len / t_load / step_tok_s:,.0f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
