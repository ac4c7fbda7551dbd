"""Text generation from a trained model (temperature / top-k sampling, no KV cache yet)."""

from __future__ import annotations

import torch


@torch.no_grad()
def generate(model, prompt_ids: list[int], max_new_tokens: int, *, max_seq_len: int, temperature: float = 0.8,
             top_k: int = 50, eos_id: int | None = None, generator: torch.Generator | None = None,
             device: torch.device | str = "cpu") -> list[int]:
    """Append up to ``max_new_tokens`` sampled ids to ``prompt_ids``; temperature 0 is greedy."""
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens; give a non-empty --prompt")
    model.eval()
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        context = ids[:, -max_seq_len:]  # the rotary table bounds the context
        logits = model(context)[0, -1].float()
        if temperature <= 0:
            nxt = logits.argmax().view(1)
        else:
            logits = logits / temperature
            if top_k and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        if eos_id is not None and nxt.item() == eos_id:
            break
    return ids[0].tolist()
