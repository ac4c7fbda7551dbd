"""Synthetic tasks: parity of bit strings and running sums modulo m (state tracking), multi-query joint
recall (Zhan et al. 2025: recall in context), and all three as a data source (``data.synthetic``) with an
accuracy-by-length evaluation (`length_accuracy`, which ``hybridtron eval`` reports).

Both are token-level: input x_1 .. x_T, and at every position t the label is the state after reading
x_1 .. x_t (the per-position formulation of Grazzi et al., "Unlocking State-Tracking in Linear RNNs
Through Negative Eigenvalues"):

    parity:   x_t in {0, 1},      y_t = x_1 xor ... xor x_t
    modadd:   x_t in [0, m),      y_t = (x_1 + ... + x_t) mod m

They are the groups Z_2 and Z_m: the answer depends on every token so far, so a model must carry a
state and update it exactly, and a test on strings longer than the training strings shows whether it
learned the update or a length-bound shortcut. A linear RNN whose transition matrices have eigenvalues
in [0, 1] (DeltaNet with beta in (0, 1), Mamba) cannot flip the sign of its state, which parity needs
(read a 1: s -> -s); with eigenvalues in [-1, 1] (beta in (0, 2): I - beta k k^T is a reflection at
beta = 2) one step does it. Z_m for m > 2 needs rotations, i.e. products of such reflections
(DeltaProduct, or several layers).

Vocabulary: ids 0 .. m - 1 are the digits (bits for parity, m = 2), ``pad_id(m) = m`` pads rows shorter
than the batch (labels -100 there), so a model needs ``vocab_size(m) = m + 1`` embeddings. Labels are
token ids of the same digits, so a language model's logits score them directly. Everything is drawn
from the given torch.Generator: the same generator state gives the same batch.
"""

from __future__ import annotations

import torch

IGNORE = -100  # label of padding positions (the cross-entropy's ignore_index)
PARITY_VOCAB = {"0": 0, "1": 1, "<pad>": 2}  # parity's tokens: the two bits and the pad


def pad_id(modulus: int) -> int:
    """The padding token of a task over digits 0 .. modulus - 1."""
    return modulus


def vocab_size(modulus: int) -> int:
    """Embeddings a model needs for the task: the digits and the pad."""
    return modulus + 1


def _lengths(batch: int, length: int, min_length: int | None, generator: torch.Generator) -> torch.Tensor:
    if min_length is None:
        return torch.full((batch,), length, dtype=torch.long)
    if not 1 <= min_length <= length:
        raise ValueError(f"min_length={min_length} must be between 1 and length={length}")
    return torch.randint(min_length, length + 1, (batch,), generator=generator)


def modadd_batch(
    batch: int, length: int, modulus: int, generator: torch.Generator, min_length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), both (batch, length) long: uniform digits in [0, modulus) and their running
    sum mod modulus. With min_length each row has a length uniform in [min_length, length]; the rest of
    the row is pad_id(modulus) with label -100 (right padding: a causal model never sees it early)."""
    if modulus < 2 or length < 1 or batch < 1:
        raise ValueError(f"need modulus >= 2, length >= 1, batch >= 1 (got {modulus}, {length}, {batch})")
    x = torch.randint(0, modulus, (batch, length), generator=generator)
    y = x.cumsum(dim=1) % modulus
    n = _lengths(batch, length, min_length, generator)
    pad = torch.arange(length)[None, :] >= n[:, None]
    return x.masked_fill(pad, pad_id(modulus)), y.masked_fill(pad, IGNORE)


def parity_batch(
    batch: int, length: int, generator: torch.Generator, min_length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels): random bits (token ids 0 / 1) and their running parity (prefix xor, ids
    0 / 1); padding as in `modadd_batch`, with PARITY_VOCAB["<pad>"] = 2."""
    return modadd_batch(batch, length, 2, generator, min_length)


@torch.no_grad()
def accuracy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    last_only: bool = False,
    min_position: int = 0,
) -> float:
    """Fraction of labelled positions where the argmax of model(input_ids) equals the label.

    Per position by default (every prefix of every row counts). min_position keeps only positions
    >= min_position (0-based), e.g. the training length, to score the unseen lengths alone. last_only
    scores each row's last labelled position ("sequence accuracy": the state after the whole string)."""
    pred = model(input_ids).argmax(dim=-1)
    mask = labels != IGNORE
    mask[:, :min_position] = False
    if last_only:
        last = torch.where(mask, torch.arange(labels.shape[1], device=labels.device), -1).amax(dim=1)
        rows = last >= 0
        return (pred[rows, last[rows]] == labels[rows, last[rows]]).float().mean().item()
    return ((pred == labels) & mask).sum().item() / max(int(mask.sum()), 1)


# --- Multi-query joint recall (Zhan et al. 2025) ------------------------------------------------------------------
#
# A row lists n_contexts contexts, each followed by its own table of n_keys (key, value) pairs in random order; a
# separator; then every context again, each key of its table asked once in random order and followed by its value.
# The label at an asked key is its value in *that* context (-100 elsewhere): the same key means different values
# in different contexts, so a model must recall (context, key) -> value for many queries in one pass, which a
# fixed-size recurrent state cannot do in sub-quadratic time (their theorem). Contexts are drawn from a pool of
# n_contexts * max(eval_scales) tokens, so a longer evaluation row (more contexts) uses no unseen symbol.
#
# Token ids: values [0, V), keys [V, V + K), contexts [V + K, V + K + P), then SEP, PAD (and EOS, in the
# tokenizer only).


def joint_recall_layout(n_keys: int, n_values: int, context_pool: int) -> dict[str, int]:
    """First id of each symbol group and the ids of the separator and the pad."""
    ctx = n_values + n_keys
    return {"key": n_values, "context": ctx, "sep": ctx + context_pool, "pad": ctx + context_pool + 1}


def joint_recall_row(n_contexts: int, n_keys: int, n_values: int, context_pool: int, generator: torch.Generator,
                     length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of one row, right-padded to ``length`` (PAD, labels -100)."""
    if context_pool < n_contexts:
        raise ValueError(f"context_pool={context_pool} must hold n_contexts={n_contexts} contexts")
    ids = joint_recall_layout(n_keys, n_values, context_pool)
    contexts = torch.randperm(context_pool, generator=generator)[:n_contexts] + ids["context"]
    table = torch.randint(0, n_values, (n_contexts, n_keys), generator=generator)
    x, y = [], []
    for phase in ("write", "ask"):
        for c in torch.randperm(n_contexts, generator=generator).tolist():
            x.append(int(contexts[c]))
            y.append(IGNORE)
            for key in torch.randperm(n_keys, generator=generator).tolist():
                x += [ids["key"] + key, int(table[c, key])]
                y += [int(table[c, key]) if phase == "ask" else IGNORE, IGNORE]
        if phase == "write":
            x.append(ids["sep"])
            y.append(IGNORE)
    n = len(x)
    length = n if length is None else length
    if length < n:
        raise ValueError(f"a joint recall row of {n_contexts} contexts x {n_keys} keys takes {n} tokens > {length}")
    x += [ids["pad"]] * (length - n)
    y += [IGNORE] * (length - n)
    return torch.tensor(x), torch.tensor(y)


def joint_recall_batch(batch: int, n_contexts: int, n_keys: int, n_values: int, generator: torch.Generator,
                       context_pool: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), both (batch, 2 + 2 n_contexts (1 + 2 n_keys)) long."""
    rows = [joint_recall_row(n_contexts, n_keys, n_values, context_pool or n_contexts, generator) for _ in range(batch)]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


# --- The tasks as a data source (data.synthetic) -----------------------------------------------------------------

EOS_TOKEN = "<|eos|>"  # the tokenizer needs an end-of-document token; no row contains it
_SPLITS = {"train": 0, "val": 1}


def task_symbols(spec) -> list[str]:
    """The tokenizer's symbols in id order for a data.synthetic section."""
    if spec.task == "joint_recall":
        pool = spec.n_contexts * max(spec.eval_scales)
        return ([f"v{i}" for i in range(spec.n_values)] + [f"k{i}" for i in range(spec.n_keys)]
                + [f"c{i}" for i in range(pool)] + ["<sep>", "<pad>", EOS_TOKEN])
    m = 2 if spec.task == "parity" else spec.modulus
    return [str(i) for i in range(m)] + ["<pad>", EOS_TOKEN]


def task_row(spec, seq_len: int, generator: torch.Generator, scale: int = 1,
             full_length: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One (input_ids, labels) row of the task at ``scale`` times its training length (seq_len for parity and
    modadd, n_contexts for joint recall; joint recall rows are padded to seq_len * scale). full_length: no
    shorter parity / modadd rows (evaluation)."""
    if spec.task == "joint_recall":
        pool = spec.n_contexts * max(spec.eval_scales)
        return joint_recall_row(spec.n_contexts * scale, spec.n_keys, spec.n_values, pool, generator, seq_len * scale)
    m = 2 if spec.task == "parity" else spec.modulus
    lo = None if full_length or not spec.min_length else spec.min_length
    x, y = modadd_batch(1, seq_len * scale, m, generator, lo)
    return x[0], y[0]


def _row_seed(seed: int, stream: int, i: int) -> int:
    return ((seed * 0x9E3779B1 + stream) * 1_000_003 + i) % (1 << 63)


class SyntheticDataset:
    """The rows of data.synthetic's task for one split, row i drawn from its own seed (seed, split, i): the loader
    (sampler.py) shuffles and resumes it like a packed corpus. Items: input_ids, labels (the answers, -100 where
    none; not next-token targets), doc_ids (one document per row)."""

    def __init__(self, cfg, split: str):
        if split not in _SPLITS:
            raise ValueError(f"split={split!r} must be 'train' or 'val'")
        self.spec, self.seq_len, self.seed, self.stream = cfg.synthetic, cfg.seq_len, cfg.seed, _SPLITS[split]
        self.n = cfg.synthetic.train_rows if split == "train" else 1000

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(f"row {i} out of range for {self.n} synthetic rows")
        g = torch.Generator().manual_seed(_row_seed(self.seed, self.stream, i))
        x, y = task_row(self.spec, self.seq_len, g)
        return {"input_ids": x, "labels": y, "doc_ids": torch.zeros(len(x), dtype=torch.int32)}


@torch.no_grad()
def length_accuracy(model: torch.nn.Module, cfg, rows: int = 64, device="cpu", batch: int = 16) -> list[dict]:
    """Accuracy of model's argmax at the labelled positions of ``rows`` fresh rows per data.synthetic.eval_scales
    entry: {scale, length, accuracy, beyond} (beyond: parity / modadd positions past the training length only).
    Rows come from seeds of their own (neither split's). A length past model.max_seq_len in a model with
    attention layers gets accuracy None (its rotary table ends there)."""
    spec, T = cfg.data.synthetic, cfg.data.seq_len
    was = model.training
    model.eval()
    out = []
    for scale in spec.eval_scales:
        g = torch.Generator().manual_seed(_row_seed(cfg.data.seed, 100 + scale, 0))
        pairs = [task_row(spec, T, g, scale, full_length=True) for _ in range(rows)]
        length = pairs[0][0].numel()
        if length > cfg.model.max_seq_len and "A" in cfg.model.layer_types():
            out.append({"scale": scale, "length": length, "accuracy": None, "beyond": None})
            continue
        hit = seen = hit_b = seen_b = 0
        for a in range(0, rows, batch):
            x = torch.stack([p[0] for p in pairs[a : a + batch]]).to(device)
            y = torch.stack([p[1] for p in pairs[a : a + batch]]).to(device)
            ok = (model(x).argmax(-1) == y) & (y != IGNORE)
            lab = y != IGNORE
            hit, seen = hit + int(ok.sum()), seen + int(lab.sum())
            hit_b, seen_b = hit_b + int(ok[:, T:].sum()), seen_b + int(lab[:, T:].sum())
        beyond = hit_b / seen_b if spec.task != "joint_recall" and seen_b else None
        out.append({"scale": scale, "length": length, "accuracy": hit / max(seen, 1), "beyond": beyond})
    model.train(was)
    return out
