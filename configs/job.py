"""The job config: one typed dataclass per section, validated before any heavy work.

Sections: ``model`` (architecture), ``data`` (sources, tokenizer, packing), ``train`` (optimizer,
schedule, loop), ``checkpoint``, ``parallel`` (layout over processes). Presets live beside this file as YAML (``tiny.yaml`` is the CPU
default); ``load_config`` merges a preset with dotted CLI overrides and validates the result.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from hybridtron.configs.base import ConfigError, apply_override, from_dict, to_dict
from hybridtron.configs.model import ModelConfig

PRESET_DIR = Path(__file__).resolve().parent


@dataclass
class SourceConfig:
    # A file, a directory, a glob, or "stdlib": the running interpreter's standard-library *.py files.
    path: str = "stdlib"
    format: Literal["auto", "text", "jsonl", "parquet"] = "auto"
    text_field: str = "text"  # column holding the text for jsonl/parquet
    name: str = ""  # directory name of this source's shards; "" = derived from the path
    weight: float = 1.0  # blending weight among sources
    max_files: int = 0  # 0 = all files matched (a cap keeps tests and demos small)


@dataclass
class TokenizerConfig:
    kind: Literal["bpe", "sentencepiece", "pretrained"] = "bpe"
    path: str = ""  # for kind=pretrained: a tokenizer.json or a SentencePiece .model
    vocab_size: int = 4096
    # MB (10^6 bytes of UTF-8 text) a trained tokenizer (bpe, sentencepiece) learns from: a sample spread over the
    # whole corpus, the same for the same config and files (data.seed draws it; data_pipeline/tokenizer_sample.py).
    # Each source gets its weight's share. Reading it takes about this much I/O and the trainer this much text in
    # memory (sentencepiece holds it all), whatever the corpus's size. 50: the text train_max_chars read before.
    sample_mb: float = 50.0
    # Replaced by sample_mb (it trained on the corpus's first train_max_chars characters). 0 (the default) = unset.
    # A config that sets it still reads a data directory whose tokenizer was made so (a run or checkpoint saved
    # before sample_mb), but prepare refuses to train a new tokenizer with it: set sample_mb instead.
    train_max_chars: int = 0


@dataclass
class SyntheticConfig:
    """A generated task instead of a text corpus (data_pipeline/synthetic.py): every row drawn from a seed, a
    word-level tokenizer of the task's symbols, labels the answer at each position (-100 where none)."""

    task: Literal["", "parity", "modadd", "joint_recall"] = ""  # "": the text corpus of data.sources
    modulus: int = 5  # modadd: running sums modulo this
    min_length: int = 0  # parity / modadd: row lengths uniform in [min_length, seq_len]; 0: all seq_len
    n_contexts: int = 4  # joint_recall: contexts per row, each with its own key -> value table ...
    n_keys: int = 4  # ... of this many keys
    n_values: int = 8  # ... over this many values
    train_rows: int = 100_000  # rows of the train split (each drawn from its index); the val split has 1000
    eval_scales: list[int] = field(default_factory=lambda: [1, 2, 4])  # eval: accuracy at these multiples of
    # the training length (parity / modadd: seq_len; joint_recall: n_contexts)

    def validate(self, seq_len: int) -> None:
        if not self.task:
            return
        if not self.eval_scales or min(self.eval_scales) < 1:
            raise ConfigError(f"data.synthetic.eval_scales={self.eval_scales} must list multiples >= 1 of the "
                              f"training length, e.g. [1, 2, 4]")
        if self.train_rows < 1:
            raise ConfigError(f"data.synthetic.train_rows={self.train_rows} must be >= 1")
        if self.task == "modadd" and self.modulus < 2:
            raise ConfigError(f"data.synthetic.modulus={self.modulus} must be >= 2")
        if self.task in ("parity", "modadd") and not 0 <= self.min_length <= seq_len:
            raise ConfigError(f"data.synthetic.min_length={self.min_length} must be in [0, data.seq_len={seq_len}]")
        if self.task == "joint_recall":
            if min(self.n_contexts, self.n_keys, self.n_values) < 1:
                raise ConfigError("data.synthetic.n_contexts, n_keys and n_values must be >= 1")
            need = 2 + 2 * self.n_contexts * (1 + 2 * self.n_keys)
            if need > seq_len:
                raise ConfigError(f"data.synthetic: a joint_recall row of {self.n_contexts} contexts x {self.n_keys} "
                                  f"keys takes {need} tokens, more than data.seq_len={seq_len}; raise seq_len to "
                                  f"{need} or lower n_contexts / n_keys")


@dataclass
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=lambda: [SourceConfig()])
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    # Prepared tokenizer + shards. "": a directory of this corpus's own, data/<name>-<fingerprint> (e.g.
    # data/stdlib-bpe4096-3f9a1c2e; data_pipeline/data_dir.py), so corpora, tokenizers and tasks never share one.
    out_dir: str = ""
    seq_len: int = 128
    val_fraction: float = 0.02  # share of documents held out for validation
    shard_docs: int = 1000  # documents per shard file
    # Read sources with datasets' streaming mode: one pass, no Arrow copy of the corpus, works for corpora
    # larger than memory or disk headroom. false materialises an Arrow cache under out_dir/.hf_cache first
    # (measured 1.17 s vs 0.41 s to read 600 stdlib files, 7.5 MB).
    streaming: bool = True
    # Tokenizing processes (data_pipeline/parts.py): each takes a part of about part_mb MB of a source's files at a
    # time; the shards are byte-identical whatever the number. 0 = the cores. A source of one part (smaller than
    # part_mb) is tokenized in the prepare process itself.
    workers: int = 0
    part_mb: float = 256.0
    num_workers: int = 0  # tokenizer threads in each of those processes; 0 = the cores shared among them
    seed: int = 0  # split and sample order
    # What prepare does with a record it cannot train on (a binary file, invalid UTF-8, a malformed jsonl line,
    # a non-string, missing or empty text, a record over max_record_mb, an unreadable file): skip it and count
    # it (counts and the first few places go to the prepare summary and the shard manifests), or error: stop
    # at the first one (empty documents are only counted). docs/data.md has the whole policy.
    on_bad_record: Literal["skip", "error"] = "skip"
    # With skip, prepare still stops when more than this share of a source's records are malformed (invalid
    # UTF-8, malformed JSON, non-string text, over max_record_mb, unreadable): that is damage, not noise.
    # Binary files and empty or missing texts do not count. 0 = stop at the first malformed record, 1 = never.
    max_malformed_fraction: float = 0.01
    # A record (a text file, a jsonl line, a parquet cell) larger than this is skipped as too large: with the
    # piecewise encoding it bounds prepare's memory whatever the documents hold.
    max_record_mb: int = 64
    # A source file added, removed or edited after its shards were made: error (refuse, naming the file) or
    # rebuild that source's shards (the tokenizer is kept). An interrupted prepare whose files changed meanwhile
    # starts the source over whatever this says (nothing can have trained on it).
    on_source_change: Literal["error", "rebuild"] = "error"
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)  # a generated task instead of sources

    def validate(self) -> None:
        self.synthetic.validate(self.seq_len)
        if not self.sources:
            raise ConfigError("data.sources is empty; give at least one source (path: stdlib is the default)")
        for i, s in enumerate(self.sources):
            if s.weight <= 0:
                raise ConfigError(f"data.sources[{i}].weight={s.weight} must be > 0")
            if s.max_files < 0:
                raise ConfigError(f"data.sources[{i}].max_files={s.max_files} must be >= 0")
        if self.tokenizer.kind == "pretrained" and not self.tokenizer.path:
            raise ConfigError("data.tokenizer.kind=pretrained needs data.tokenizer.path (tokenizer.json or .model)")
        if not 0 < self.tokenizer.sample_mb < float("inf"):
            raise ConfigError(f"data.tokenizer.sample_mb={self.tokenizer.sample_mb} must be a number of MB > 0 (the "
                              f"text sampled from the corpus to train the tokenizer on), e.g. 50")
        if self.tokenizer.train_max_chars < 0:
            raise ConfigError(f"data.tokenizer.train_max_chars={self.tokenizer.train_max_chars} must be >= 0; it is "
                              f"replaced by data.tokenizer.sample_mb (leave it 0)")
        if self.tokenizer.kind != "pretrained" and self.tokenizer.vocab_size < 259:
            raise ConfigError(
                f"data.tokenizer.vocab_size={self.tokenizer.vocab_size} is too small; "
                f"a byte-level vocabulary needs at least 259 ids (256 bytes + BOS/EOS/PAD)"
            )
        if self.seq_len <= 0:
            raise ConfigError(f"data.seq_len={self.seq_len} must be positive")
        if not 0.0 < self.val_fraction < 0.5:
            raise ConfigError(f"data.val_fraction={self.val_fraction} must be in (0, 0.5)")
        if self.shard_docs <= 0 or self.num_workers < 0:
            raise ConfigError("data.shard_docs must be > 0 and data.num_workers >= 0")
        if self.workers < 0:
            raise ConfigError(f"data.workers={self.workers} must be >= 0 (0: as many as the cores)")
        if not self.part_mb > 0:
            raise ConfigError(f"data.part_mb={self.part_mb} must be > 0 (MB of source files per part)")
        if self.on_bad_record not in ("skip", "error"):
            raise ConfigError(f"data.on_bad_record={self.on_bad_record!r} must be 'skip' or 'error'")
        if not 0.0 <= self.max_malformed_fraction <= 1.0:
            raise ConfigError(f"data.max_malformed_fraction={self.max_malformed_fraction} must be in [0, 1]")
        if self.max_record_mb <= 0:
            raise ConfigError(f"data.max_record_mb={self.max_record_mb} must be > 0")
        if self.on_source_change not in ("error", "rebuild"):
            raise ConfigError(f"data.on_source_change={self.on_source_change!r} must be 'error' or 'rebuild'")


@dataclass
class ProfileConfig:
    """What ``train/profile.py`` records; nothing unless asked."""

    # [first, last] (1-based, inclusive): a torch.profiler trace of these steps, per rank, under the run
    # directory's profile/; []: none.
    steps: list[int] = field(default_factory=list)
    # CUDA only: record the allocator's history over those steps and dump a snapshot after the last; without
    # steps, over the whole run. Either way an out-of-memory error while recording dumps one and names it.
    memory: bool = False

    def validate(self, max_steps: int) -> None:
        if not self.steps:
            return
        if len(self.steps) != 2 or not 1 <= self.steps[0] <= self.steps[1] <= max_steps:
            raise ConfigError(f"train.profile.steps={self.steps} must be [first, last] with 1 <= first <= last <= "
                              f"train.max_steps={max_steps}, e.g. [5, 7]; [] profiles nothing")


@dataclass
class TrainConfig:
    max_steps: int = 200
    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    seed: int = 1234
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # final LR as a fraction of lr (cosine, WSD)
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = 20  # at or above max_steps (a smoke run): a tenth of max_steps instead (train/schedule.py)
    decay_fraction: float = 0.2  # WSD: share of steps in the final decay
    # A resume whose schedule settings differ from its checkpoint's (train/schedule.py): keep the checkpoint's
    # curve (only max_steps moves: WSD decays at the new end, a cosine holds its floor), or replan the config's
    # schedule from the current LR. Neither makes the LR jump.
    schedule_on_resume: Literal["keep", "replan"] = "keep"
    weight_decay: float = 0.1
    decay_embeddings: bool = False
    decay_norms: bool = False
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU
    # none | full (recompute each whole block in backward) | selective (keep matmul, attention and delta-rule
    # outputs, recompute the cheap elementwise ops between them); true/false are read as full/none.
    activation_checkpointing: Literal["none", "full", "selective"] | bool = "none"
    # With full: checkpoint every k-th block only (1 = all); the others keep their activations.
    activation_checkpointing_every: int = 1
    # torch.compile each block (in place: parameter names and checkpoints unchanged), after activation
    # checkpointing and before data parallel; the fused kernels are custom ops it traces without graph breaks.
    compile: bool = False
    # FP8 matmuls for the blocks' linear layers through torchao's float8 training (pip install 'hybridtron[fp8]'):
    # tensorwise (one scale per tensor; FSDP2 then all-gathers the weights in FP8) or rowwise (one scale per row:
    # closer to bf16, a little slower). Compute only: weights, optimizer state and checkpoints stay as they are,
    # so a run resumes with FP8 switched on or off. Needs a GPU with FP8 tensor cores (sm_89 and newer).
    fp8: Literal["none", "tensorwise", "rowwise"] = "none"
    eval_every: int = 50  # 0 disables periodic evaluation
    eval_batches: int = 8
    log_every: int = 1
    nan_policy: Literal["stop", "skip"] = "stop"
    # Loss-spike guard (train/spike.py): a step whose loss or gradient norm lies more than spike_threshold standard
    # deviations above the last spike_window steps' is logged (warn), not applied (skip), or stops the run (stop).
    spike_policy: Literal["warn", "skip", "stop"] = "warn"
    spike_threshold: float = 6.0
    spike_window: int = 100
    peak_flops: float = 0.0  # per-device peak for MFU; 0: look the device up in a table
    progress_bar: bool = True
    # Stop (after saving a checkpoint) when the step is a multiple of this; 0 = never. Like
    # Megatron's --exit-interval: time-sliced jobs and preemption drills end at a chosen step.
    exit_interval: int = 0
    # Debug: parameter names (as in the model's named_parameters, e.g. layers.0.mlp.down_proj.weight) whose whole
    # fp32 gradients of the run's first step (before clipping) go to <run_dir>/grads_step1.pt, in the model's
    # layout whatever the parallel one: a parallel run's gradients can then be compared with one process's.
    dump_grads: list[str] = field(default_factory=list)
    profile: ProfileConfig = field(default_factory=ProfileConfig)  # traces and memory snapshots of chosen steps
    # Hang watch (train/watchdog.py): after the first step, a rank whose phase (data, forward, backward, optimizer,
    # checkpoint, eval) has not moved for this many seconds while no other rank moves either names the ranks that
    # did not arrive and exits with code 6 (the SLURM job restarts from the latest checkpoint); the process groups'
    # timeout drops to it plus 60 s. Above the longest step, checkpoint write and evaluation; 0 = off (torch's
    # 30-minute collective timeout only). 600 s: a hung 1,024-GPU job loses 10 minutes, not 30.
    hang_timeout_s: float = 600.0
    # A rank whose work per step (its step time less its waits for the others) exceeds the median rank's by this
    # share, or that was not running for this share of its step time, is named as a straggler at each log step (in
    # the log, metrics.jsonl and `hybridtron status`). 0 = do not look.
    straggler_margin: float = 0.2

    def validate(self) -> None:
        for name in ("max_steps", "micro_batch_size", "grad_accum_steps", "eval_batches", "log_every"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name}={getattr(self, name)} must be a positive integer")
        if self.lr <= 0:
            raise ConfigError(f"train.lr={self.lr} must be > 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.exit_interval < 0:
            raise ConfigError(f"train.exit_interval={self.exit_interval} must be >= 0 (0 = never)")
        if self.warmup_steps < 0 or self.eval_every < 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError("train.warmup_steps, eval_every, grad_clip and weight_decay must be >= 0")
        if self.spike_policy not in ("warn", "skip", "stop"):
            raise ConfigError(f"train.spike_policy={self.spike_policy!r} must be 'warn', 'skip' or 'stop'")
        if self.spike_threshold <= 0 or self.spike_window < 2:
            raise ConfigError(f"train.spike_threshold={self.spike_threshold} must be > 0 and train.spike_window="
                              f"{self.spike_window} >= 2 (steps of history a step is scored against)")
        if self.schedule_on_resume not in ("keep", "replan"):
            raise ConfigError(f"train.schedule_on_resume={self.schedule_on_resume!r} must be 'keep' or 'replan'")
        if isinstance(self.activation_checkpointing, bool):
            self.activation_checkpointing = "full" if self.activation_checkpointing else "none"
        if self.activation_checkpointing_every < 1:
            raise ConfigError(f"train.activation_checkpointing_every={self.activation_checkpointing_every} must be >= 1")
        if self.activation_checkpointing_every > 1 and self.activation_checkpointing != "full":
            raise ConfigError(
                f"train.activation_checkpointing_every={self.activation_checkpointing_every} applies to "
                f"activation_checkpointing=full only (it is {self.activation_checkpointing!r}); set it to 1 or use full"
            )
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ConfigError(f"train.decay_fraction={self.decay_fraction} must be in (0, 1]")
        if self.fp8 not in ("none", "tensorwise", "rowwise"):
            raise ConfigError(f"train.fp8={self.fp8!r} is not allowed; use none, tensorwise or rowwise")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"train.device={self.device!r} is not allowed; use auto, cpu, cuda or cuda:N")
        names = self.dump_grads
        if not all(isinstance(n, str) and n for n in names) or len(set(names)) < len(names):
            raise ConfigError(f"train.dump_grads={self.dump_grads!r} must be distinct parameter names "
                              f"(e.g. [embed_tokens.weight, layers.0.mlp.down_proj.weight])")
        if not (self.hang_timeout_s == 0 or 1 <= self.hang_timeout_s < float("inf")):
            raise ConfigError(f"train.hang_timeout_s={self.hang_timeout_s} must be >= 1 second (0 = no hang watch)")
        if not 0 <= self.straggler_margin:
            raise ConfigError(f"train.straggler_margin={self.straggler_margin} must be >= 0 (0 = do not look)")
        self.profile.validate(self.max_steps)


@dataclass
class CheckpointConfig:
    every: int = 100  # steps between checkpoints; 0 = only at the end
    keep_last: int = 3  # complete checkpoints kept; older ones are deleted
    at_exit: bool = True  # also save when the run ends or receives SIGTERM/SIGINT
    # YAML/CLI key `async` (a Python keyword): copy the state to host memory at the save, then write it in the
    # background while training goes on; the next save, a stop or the end waits for the write. `latest` moves only
    # once the write is complete and checksummed, as with a synchronous save, and the files are the same.
    async_save: bool = field(default=False, metadata={"key": "async"})

    def validate(self) -> None:
        if self.every < 0 or self.keep_last < 1:
            raise ConfigError(
                f"checkpoint.every={self.every} must be >= 0 and checkpoint.keep_last={self.keep_last} >= 1"
            )


@dataclass
class ParallelConfig:
    """How a run is laid out over its processes (``torchrun --nproc-per-node N``; one process: all 1).

    The world size must be the product dp x tp x pp x cp; dp = -1 takes what the others leave; ep (expert
    parallel) divides dp and splits MoE experts over groups of ep data-parallel ranks. tp splits every
    attention and feed-forward layer over tp ranks (Megatron-style column/row sharding, with sequence
    parallelism between them, vocabulary-parallel embedding and loss); the tp ranks of a node should share it. ZeRO stage of
    the data-parallel dimension: 0 replicates the model (DDP, gradients all-reduced), 2 shards optimizer state
    and gradients and keeps the gathered parameters from forward to backward (FSDP2 without resharding after
    forward), 3 shards parameters too (FSDP2, parameters gathered per layer and freed after use). dp_shard < dp
    (ZeRO 2/3) is hybrid sharding (HSDP): shard within groups of dp_shard neighbouring dp ranks, replicate over the
    dp / dp_shard groups, so the gathers stay inside a node and only a gradient all-reduce crosses nodes."""

    dp: int = -1
    dp_shard: int = -1  # ranks FSDP2 shards over (a divisor of dp); -1: all of dp
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    zero_stage: int = 0
    # Data-parallel engine: torch (DDP for ZeRO 0, FSDP2 for 2/3) or deepspeed (ZeRO 0-3, optimizer offload).
    engine: Literal["torch", "deepspeed"] = "torch"
    # deepspeed: a DeepSpeed JSON of your own, used as given; the keys it lacks come from this config, and a key
    # it sets to another value than this config's (batch sizes, clipping, ZeRO stage) is refused by name.
    deepspeed_config: str = ""
    offload_optimizer: bool = False  # deepspeed: optimizer state and step on the CPU (ZeRO-Offload)
    # torch engine, ZeRO 2/3: FSDP2's CPUOffloadPolicy: parameter, gradient and optimizer-state shards live in host
    # memory, each layer's parameters copied to the device for its all-gather, the optimizer step run on the CPU.
    offload: Literal["none", "cpu"] = "none"
    # FSDP2 mixed precision (GPU): parameters gathered and computed in bf16, gradients reduced in fp32. "auto":
    # on when train.dtype resolves to bf16; the sharded master weights and optimizer state stay fp32.
    mixed_precision: Literal["auto", "off"] = "auto"
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl on CUDA, gloo on the CPU
    # Pipeline parallel (pp > 1): the layers are cut into pp x pp_stages_per_rank stages, balanced by an estimate
    # of each layer's FLOPs, and run by a torch.distributed.pipelining schedule over train.grad_accum_steps
    # micro-batches: gpipe and 1f1b take one stage per rank, interleaved_1f1b and zero_bubble (the interleaved
    # zero-bubble schedule: input and weight gradients computed apart to fill the bubble) two or more.
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = "1f1b"
    pp_stages_per_rank: int = 1

    def validate(self) -> None:
        """Each field on its own; how they combine with each other, the world size and the rest of the job is the
        layout's (train/parallel/layout.py), checked before a run allocates anything."""
        if self.dp == 0 or self.dp < -1:
            raise ConfigError(f"parallel.dp={self.dp} must be a positive integer, or -1 (what tp x pp x cp leave)")
        for name in ("tp", "pp", "ep", "cp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name}={getattr(self, name)} must be a positive integer (1 = off)")
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ConfigError(f"parallel.dp_shard={self.dp_shard} must be a positive integer, or -1 (shard over all "
                              f"of dp)")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.zero_stage={self.zero_stage} must be 0, 1, 2 or 3")
        if self.engine not in ("torch", "deepspeed"):
            raise ConfigError(f"parallel.engine={self.engine!r} must be 'torch' or 'deepspeed'")
        if self.deepspeed_config and not Path(self.deepspeed_config).is_file():
            raise ConfigError(f"parallel.deepspeed_config={self.deepspeed_config!r} is not a file; give the path of a "
                              f"DeepSpeed JSON")
        schedules = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
        if self.pp_schedule not in schedules:
            raise ConfigError(f"parallel.pp_schedule={self.pp_schedule!r} must be one of {', '.join(schedules)}")
        if self.pp_stages_per_rank < 1:
            raise ConfigError(f"parallel.pp_stages_per_rank={self.pp_stages_per_rank} must be a positive integer")


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate(self) -> JobConfig:
        """Every section's fields, and the sequence length against the rotary table. The rules that tie the layout,
        the kernels and the device to the job are train/parallel/layout.py's (configs/ imports nothing above it)."""
        self.model.validate()
        self.data.validate()
        self.train.validate()
        self.checkpoint.validate()
        self.parallel.validate()
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"data.seq_len={self.data.seq_len} exceeds the rotary table model.max_seq_len="
                f"{self.model.max_seq_len}; lower data.seq_len or raise model.max_seq_len"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def resolve_preset(name_or_path: str) -> Path:
    """``tiny`` or ``configs/tiny.yaml`` or any YAML path -> an existing file."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    cand = PRESET_DIR / (name_or_path if name_or_path.endswith(".yaml") else name_or_path + ".yaml")
    if cand.is_file():
        return cand
    presets = sorted(x.stem for x in PRESET_DIR.glob("*.yaml"))
    close = difflib.get_close_matches(Path(name_or_path).stem, presets, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(f"config {name_or_path!r} is neither a file nor a preset; {hint}presets: {presets}")


def load_config(path: str | None = None, overrides: list[tuple[str, Any]] | None = None) -> JobConfig:
    """Preset/YAML file (or defaults) + dotted overrides -> a validated JobConfig."""
    if path:
        f = resolve_preset(path)
        try:
            raw = yaml.safe_load(f.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {f} is not valid YAML: {e}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {f} is not text (not UTF-8); point --config at a YAML file") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {f} must hold a mapping of sections, got {type(raw).__name__}")
        cfg = from_dict(JobConfig, raw)
    else:
        cfg = JobConfig()
    for key, val in overrides or []:
        apply_override(cfg, key, val)
    return cfg.validate()


def check_overrides(overrides: list[tuple[str, Any]]) -> None:
    """Each dotted override names a config key and takes a value of its type: checked against the defaults, for
    the commands whose config is read later (a checkpoint's), so that a mistyped key is said first."""
    cfg = JobConfig()
    for key, val in overrides:
        apply_override(cfg, key, val)


def config_from_dict(raw: dict[str, Any]) -> JobConfig:
    return from_dict(JobConfig, raw).validate()
