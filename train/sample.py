"""Text generation from a trained model (temperature / top-k sampling) with a decoding cache.

The prompt is run once to fill the cache (attention keys/values, delta-rule conv windows and
recurrent states); every further token is one position through the model, so a delta-rule layer
costs O(1) per token and an attention layer O(context). When the context reaches the rotary table
(model.max_seq_len) the cache is rebuilt from the last half of the context.
"""

from __future__ import annotations

import torch


def _sample(logits: torch.Tensor, temperature: float, top_k: int, generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax().view(1)
    logits = logits / temperature
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)


@torch.no_grad()
def generate(model, prompt_ids: list[int], max_new_tokens: int, *, max_seq_len: int, temperature: float = 0.8,
             top_k: int = 50, eos_id: int | None = None, generator: torch.Generator | None = None,
             device: torch.device | str = "cpu") -> list[int]:
    """Append up to ``max_new_tokens`` sampled ids to ``prompt_ids``; temperature 0 is greedy."""
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens; give a non-empty --prompt")
    model.eval()
    ids = list(prompt_ids)
    cache = model.new_cache()
    logits = model(torch.tensor([ids[-max_seq_len:]], device=device), cache=cache)[0, -1]
    for _ in range(max_new_tokens):
        nxt = _sample(logits.float(), temperature, top_k, generator)
        ids.append(int(nxt))
        if eos_id is not None and ids[-1] == eos_id:
            break
        if cache.pos >= max_seq_len:  # the rotary table is full: re-read the recent half into a new cache
            cache = model.new_cache()
            logits = model(torch.tensor([ids[-(max_seq_len // 2):]], device=device), cache=cache)[0, -1]
        else:
            logits = model(nxt.view(1, 1).to(device), cache=cache)[0, -1]
    return ids
