"""HAX, the sparse attention branch of the Gated DeltaNet mixer (model/hax.py): the key choice against a
per-query loop written from its definition, the running document sums, cached decoding against the full
forward (documents included), causality and document isolation, and the key scorer's ranking loss."""

from __future__ import annotations

import pytest
import torch

from hybridtron.configs import ConfigError, ModelConfig
from hybridtron.configs.model import DeltaNetConfig
from hybridtron.model import GatedLM
from hybridtron.model.hax import HAX, doc_cumsum, select_keys

V = 50
KINDS = ["hax", "lsh", "key_selection", "window"]


def build(kind="hax", pattern="LA", keys=4, bits=2, **kw) -> GatedLM:
    cfg = ModelConfig(d_model=32, n_layers=len(pattern), n_heads=4, n_kv_heads=2, max_seq_len=64, ffn_hidden=64,
                      layer_pattern=pattern, deltanet=DeltaNetConfig(sparse_attention=kind, sparse_keys=keys,
                                                                     lsh_bits=bits, **kw))
    cfg.validate()
    model = GatedLM(cfg, V)
    torch.manual_seed(0)
    model.init_weights()
    return model.double()


def tokens(B=2, T=19, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunk", [3, 7, 256])
def test_select_keys_matches_a_per_query_loop(chunk):
    """Every query's chosen set: the n latest keys of its bucket (LSH), then the n best-scored keys not chosen
    yet (KS), all at positions <= its own and in its document; -1 fills the rest."""
    g = torch.Generator().manual_seed(0)
    B, L, T, n = 2, 5, 30, 3
    N = L + T
    k_doc = torch.cat([torch.tensor([[-1, -1, 0, 0, 0], [-1, 0, 0, 0, 0]]), (torch.rand(B, T, generator=g) < 0.15).cumsum(1)], 1)
    q_doc = k_doc[:, L:]
    k_bucket = torch.randint(0, 3, (B, N), generator=g)
    score = torch.randn(B, N, generator=g, dtype=torch.float64)
    q_bucket = torch.randint(0, 3, (B, T), generator=g)  # a query's bucket need not be its own key's
    got = select_keys(("lsh", "key_selection"), n, k_doc, q_doc, k_bucket, q_bucket, score, chunk=chunk)
    assert got.shape == (B, T, 2 * n)
    for b in range(B):
        for t in range(T):
            p = L + t
            mine = [j for j in range(p + 1) if k_doc[b, j] == q_doc[b, t]]
            lsh = [j for j in mine if k_bucket[b, j] == q_bucket[b, t]][-n:]
            ks = sorted(mine, key=lambda j: -score[b, j].item())[:n]
            want = set(lsh) | set(ks)
            row = [j for j in got[b, t].tolist() if j >= 0]
            assert len(row) == len(set(row)) and set(row) == want, (b, t)


def test_window_takes_the_latest_keys_of_the_document():
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    got = select_keys(("window",), 3, doc, doc)
    want = [[0], [0, 1], [0, 1, 2], [3], [3, 4], [3, 4, 5], [4, 5, 6], [5, 6, 7]]
    assert [sorted(j for j in r if j >= 0) for r in got[0].tolist()] == want


def test_doc_cumsum_restarts_at_documents_and_continues_init():
    x = torch.randn(2, 9, 3, dtype=torch.float64)
    ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2, 2], [5] * 9])
    starts = torch.zeros(2, 9, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    init = torch.randn(2, 3, dtype=torch.float64)
    want = torch.zeros_like(x)
    for b in range(2):
        acc = init[b].clone()
        for t in range(9):
            if starts[b, t]:
                acc = torch.zeros(3, dtype=torch.float64)
            acc = acc + x[b, t]
            want[b, t] = acc
    torch.testing.assert_close(doc_cumsum(x, starts, init), want)


@pytest.mark.parametrize("kind, with_docs", [("hax", False), *((kind, True) for kind in KINDS)])
def test_incremental_decoding_equals_full_forward(kind, with_docs):
    model = build(kind).eval()
    x = tokens()
    docs = torch.tensor([[0] * 5 + [1] * 4 + [2] * 10, [0] * 19]) if with_docs else None
    sl = (lambda a, b: docs[:, a:b]) if with_docs else (lambda a, b: None)
    full = model(x, doc_ids=docs)
    cache = model.new_cache()  # a prompt (a document starts inside it), a chunk (another starts), single tokens
    parts = [model(x[:, :7], doc_ids=sl(0, 7), cache=cache), model(x[:, 7:11], doc_ids=sl(7, 11), cache=cache)]
    parts += [model(x[:, t : t + 1], doc_ids=sl(t, t + 1), cache=cache) for t in range(11, 19)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-10)
    hax = model.layers[0].linear_attn.hax
    with torch.no_grad():  # the branch is live: without it the logits move
        hax.out_scale.zero_()
    assert (model(x, doc_ids=docs) - full).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["hax", "window"])
def test_branch_is_causal_and_keeps_to_its_document(kind):
    model = build(kind, pattern="L").eval()
    x = tokens(B=1, T=16)
    docs = torch.tensor([[0] * 6 + [1] * 10])
    base = model(x, doc_ids=docs)
    y = x.clone()
    y[0, 2] = (y[0, 2] + 1) % V  # inside document 0: document 1 must not notice
    out = model(y, doc_ids=docs)
    assert (out[0, 6:] - base[0, 6:]).abs().max() < 1e-12 and (out[0, 2:6] - base[0, 2:6]).abs().max() > 0
    y = x.clone()
    y[0, 12] = (y[0, 12] + 1) % V  # a later token: earlier positions must not notice
    out = model(y, doc_ids=docs)
    assert (out[0, :12] - base[0, :12]).abs().max() < 1e-12 and (out[0, 12:] - base[0, 12:]).abs().max() > 0


def test_each_query_reads_at_most_sparse_keys_keys():
    """With 4 keys per query the branch at position t differs from full attention over t's prefix once the
    prefix is longer than 4 (a sparse choice), and equals it while the prefix has at most 2 keys (both sources
    see them all)."""
    model = build("hax", pattern="L", keys=4).eval()
    hax = model.layers[0].linear_attn.hax
    seen = {}
    hook = hax.register_forward_hook(lambda m, a, o: seen.update(x=a[0], out=o))
    model(tokens(B=1, T=12))
    hook.remove()
    x = seen["x"]
    q, k = hax.qk_proj(x).split(hax.dim, -1)
    logits = (q @ k.transpose(1, 2)) * hax.dim ** -0.5
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    dense = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1) @ x * hax.out_scale
    gap = (seen["out"] - dense).abs().amax(-1)[0]
    assert gap[:2].max() < 1e-12 and gap[6:].min() > 1e-6


def test_ranking_loss_prefers_scores_ordered_like_key_importance():
    """The importance of key j is the sum over its readers t >= j of sigmoid(q_t . k_j / sqrt(d)) (computed
    here from the definition): scores in that order cost less than scores in the reverse order."""
    model = build("key_selection", pattern="L", keys=64)
    hax = model.layers[0].linear_attn.hax
    g = torch.Generator().manual_seed(3)
    T, D = 10, hax.dim
    q, k = torch.randn(1, T, D, generator=g), torch.randn(1, T, D, generator=g)
    doc = torch.zeros(1, T, dtype=torch.long)
    imp = torch.tensor([sum(torch.sigmoid(q[0, t] @ k[0, j] / D ** 0.5) for t in range(j, T)) for j in range(T)])
    right = hax.ranking_loss(q, k, 5 * imp[None], doc)
    wrong = hax.ranking_loss(q, k, -5 * imp[None], doc)
    flat = hax.ranking_loss(q, k, torch.zeros(1, T), doc)
    assert right < flat < wrong
    assert abs(flat.item() - torch.log(torch.tensor(2.0)).item()) < 1e-6  # equal scores: BCE of logit 0


def test_scorer_learns_only_from_the_ranking_loss():
    model = build("hax", pattern="L").train()
    x = tokens()
    lm = model(x, labels=x) - model.aux_loss()
    scorer = model.layers[0].linear_attn.hax.scorer
    grads = torch.autograd.grad(lm, list(scorer.parameters()), allow_unused=True, retain_graph=True)
    assert all(gr is None or gr.abs().max() == 0 for gr in grads)  # the key choice passes no gradient
    aux = model.layers[0].linear_attn.hax.aux_loss
    assert aux is not None and all(gr.abs().max() > 0 for gr in torch.autograd.grad(aux, list(scorer.parameters())))
    model.eval()
    model(x, labels=x)
    assert model.aux_loss() == 0  # evaluation losses carry no ranking term


@pytest.mark.parametrize("field, value, match", [
    ("sparse_keys", 1, "sparse_keys=1 must be >= 2"),
    ("lsh_bits", 0, "lsh_bits=0 must be in"),
    ("ranking_loss_weight", -1.0, "ranking_loss_weight"),
])
def test_bad_sparse_attention_settings_are_refused(field, value, match):
    cfg = ModelConfig(layer_pattern="L", deltanet=DeltaNetConfig(sparse_attention="hax", **{field: value}))
    with pytest.raises(ConfigError, match=match):
        cfg.validate()


def test_hax_module_without_a_key_source_has_no_scorer_or_buffer():
    cfg = ModelConfig(layer_pattern="L", deltanet=DeltaNetConfig(sparse_attention="window"))
    m = HAX(cfg, 64)
    assert not hasattr(m, "scorer") and "lsh_proj" not in dict(m.named_buffers())


def test_export_sends_the_branch_to_the_custom_code():
    """No transformers class carries the branch: export chooses our custom code and names the branch as the
    reason (tests/train/test_export_custom.py checks the exported model), before loading any weights."""
    from hybridtron.train.hf.export import choose_target, custom_features

    cfg = ModelConfig(layer_pattern="LA", n_layers=2, deltanet=DeltaNetConfig(sparse_attention="hax"))
    assert choose_target(cfg) == "hybridtron"
    assert custom_features(cfg) == ["model.deltanet.sparse_attention=hax (HAX sparse attention in the Gated DeltaNet "
                                    "mixer)"]
    cfg.deltanet.sparse_attention = "none"
    assert choose_target(cfg) == "qwen3_5_text"
    cfg = ModelConfig(layer_pattern="A", n_layers=2, deltanet=DeltaNetConfig(sparse_attention="hax"))
    assert choose_target(cfg) == "qwen3_5_text"  # no Gated DeltaNet layer, so no branch


@pytest.mark.parametrize("parallel", [("parallel.cp", "2"), ("parallel.tp", "2")])
def test_context_and_tensor_parallelism_are_refused_by_name(parallel):
    from hybridtron.configs import load_config
    from hybridtron.train.parallel.layout import Layout

    with pytest.raises(ConfigError, match="sparse_attention=hax with parallel.cp"):
        Layout.from_config(load_config("tiny_hax", [parallel]), 2)
