"""Where a corpus's prepared data lives, and what the tokenizer there was made for.

``data.out_dir`` left empty (the default) means a directory of the corpus's own, ``data/<name>-<fingerprint>``
(e.g. ``data/stdlib-bpe4096-3f9a1c2e``, ``data/parity-5d0b7e21``): two corpora, tokenizers or synthetic tasks
never share one, so preparing one never overwrites another's tokenizer. The fingerprint covers exactly what
changes the files prepare writes there:

- the tokenizer: for a trained one (bpe, sentencepiece) its kind, vocab_size, sample_mb, seed and sampling version
  (tokenizer_sample.SAMPLE_VERSION) and what it is trained on (each source's path, format, text_field, max_files and
  weight, the weight being its share of the training text; max_record_mb); a config that sets the former
  train_max_chars keeps the recipe that version recorded, so its directory is found; for a pretrained one the sha256 of its file's bytes, never its path; for a
  synthetic task the task and the settings its symbols depend on;
- the shards (a text corpus only): each source's name, path, format, text_field and max_files; seed,
  val_fraction, shard_docs and max_record_mb.

Settings used only when the data is read or that only decide how fast it is made (seq_len, streaming, workers,
part_mb, num_workers, the rows of a synthetic task) or that
only decide whether prepare stops (on_bad_record, max_malformed_fraction, on_source_change) stay out.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict
from pathlib import Path

from hybridtron.configs.job import DataConfig, SourceConfig
from hybridtron.data_pipeline.errors import DataNotFoundError
from hybridtron.data_pipeline.sources import source_name
from hybridtron.data_pipeline.tokenizer_sample import SAMPLE_VERSION

DATA_ROOT = Path("data")  # default directories go here, relative to the working directory
_NAME_CHARS = 32  # the readable part of a default directory's name is cut to this


def file_sha256(path: str | Path) -> str:
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataNotFoundError(f"data.tokenizer.path={path} is not a file; give a tokenizer.json or a SentencePiece "
                                f".model")
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _synthetic_recipe(cfg: DataConfig) -> dict:
    s = cfg.synthetic
    if s.task == "modadd":
        return {"synthetic": s.task, "modulus": s.modulus}
    if s.task == "joint_recall":  # the context pool holds n_contexts contexts per scale (synthetic.task_symbols)
        return {"synthetic": s.task, "n_contexts": s.n_contexts, "n_keys": s.n_keys, "n_values": s.n_values,
                "context_pool": s.n_contexts * max(s.eval_scales)}
    return {"synthetic": s.task}


def tokenizer_recipe(cfg: DataConfig) -> dict:
    """What the tokenizer of ``cfg`` is made from; prepare records it beside the tokenizer
    (tokenizer_meta.json's ``config``) and refuses a directory whose tokenizer was made from something else."""
    if cfg.synthetic.task:
        return _synthetic_recipe(cfg)
    t = cfg.tokenizer
    if t.kind == "pretrained":
        return {"kind": "pretrained", "sha256": file_sha256(t.path)}
    sources = [{"path": s.path, "format": s.format, "text_field": s.text_field, "max_files": s.max_files,
                "weight": s.weight} for s in cfg.sources]
    if t.train_max_chars:  # the recipe of a version that trained on the corpus's first characters (prepare only
        # reads a directory holding such a tokenizer, never trains one)
        return {"kind": t.kind, "vocab_size": t.vocab_size, "train_max_chars": t.train_max_chars,
                "max_record_mb": cfg.max_record_mb, "sources": sources}
    return {"kind": t.kind, "vocab_size": t.vocab_size, "sample_mb": t.sample_mb, "sample": SAMPLE_VERSION,
            "seed": cfg.seed, "max_record_mb": cfg.max_record_mb, "sources": sources}


def _corpus_key(cfg: DataConfig) -> dict:
    if cfg.synthetic.task:  # only a tokenizer is written (the rows are generated when read)
        return {"tokenizer": tokenizer_recipe(cfg)}
    return {"tokenizer": tokenizer_recipe(cfg),
            "sources": [{"name": source_name(s), "path": s.path, "format": s.format, "text_field": s.text_field,
                         "max_files": s.max_files} for s in cfg.sources],
            "seed": cfg.seed, "val_fraction": cfg.val_fraction, "shard_docs": cfg.shard_docs,
            "max_record_mb": cfg.max_record_mb}


def _glob_stem(path: str) -> str | None:
    """What a glob path names, for a directory name: its last part that is more than glob characters and an
    extension (``corpus/*.jsonl`` -> ``corpus``, ``web/**/shard-*.jsonl.gz`` -> ``shard``); None without glob
    characters, or when no part names anything."""
    if not re.search(r"[*?\[\]]", path):
        return None
    p = Path(path)
    for part in reversed(p.parts[1:] if p.anchor else p.parts):
        stem = re.sub(r"[*?\[\]]", "", part).split(".")[0].strip("_-")
        if stem:
            return stem
    return None


def _readable_name(cfg: DataConfig) -> str:
    if cfg.synthetic.task:
        name = cfg.synthetic.task
    else:
        src = cfg.sources[0]
        # A glob's source_name (recorded in the shards' manifest and the fingerprint, so kept as it is) is often
        # "source" (corpus/*.jsonl): the directory is named after what the glob's path names instead.
        first = (None if src.name else _glob_stem(src.path)) or source_name(src)
        first = first[:_NAME_CHARS]
        more = f"-and{len(cfg.sources) - 1}" if len(cfg.sources) > 1 else ""
        t = cfg.tokenizer
        tok = {"bpe": f"bpe{t.vocab_size}", "sentencepiece": f"sp{t.vocab_size}"}.get(t.kind, t.kind)
        name = f"{first}{more}-{tok}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).lstrip("._-") or "data"


def default_data_dir(cfg: DataConfig, root: Path = DATA_ROOT) -> Path:
    """``root/<readable name>-<8 hex digits>``: the directory of the corpus ``cfg`` describes."""
    key = json.dumps(_corpus_key(cfg), sort_keys=True)
    return Path(root) / f"{_readable_name(cfg)}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def data_dir(cfg: DataConfig) -> Path:
    """The directory prepare writes and the datasets read: ``data.out_dir`` as given, or the corpus's own."""
    return Path(cfg.out_dir).expanduser() if cfg.out_dir else default_data_dir(cfg)


def resolve_out_dir(cfg: DataConfig) -> DataConfig:
    """Set an empty ``data.out_dir`` to the corpus's own directory (a given one is kept as is); returns ``cfg``.
    Called where a command settles its config, so the run's saved config.yaml names the directory it used."""
    if not cfg.out_dir:
        cfg.out_dir = str(default_data_dir(cfg))
    return cfg


def _non_default(src: dict) -> str:
    defaults = asdict(SourceConfig())
    extra = ", ".join(f"{k} {v}" for k, v in src.items() if k != "path" and k in defaults and v != defaults[k])
    return f"{src.get('path')}" + (f" ({extra})" if extra else "")


def describe_recipe(recipe: dict) -> str:
    """A tokenizer_recipe (or what an older version recorded) in a few words: "a tokenizer made from ..."."""
    if "synthetic" in recipe:
        rest = ", ".join(f"{k} {v}" for k, v in recipe.items() if k != "synthetic")
        return f"synthetic task {recipe['synthetic']}" + (f" ({rest})" if rest else "")
    if recipe.get("kind") == "pretrained":
        return (f"the tokenizer file with sha256 {recipe['sha256'][:12]}" if "sha256" in recipe
                else f"the tokenizer file {recipe.get('path')}")
    keys = [k for k in ("vocab_size", "train_max_chars", "sample_mb", "sample", "seed", "max_record_mb") if k in recipe]
    what = f"{recipe.get('kind')} training ({', '.join(f'{k} {recipe[k]}' for k in keys)})"
    if "sources" in recipe:
        what += " on " + "; ".join(_non_default(s) for s in recipe["sources"])
    return what
