"""The engine of a run (train/engine.py): the trainer never asks which engine or layout it runs (issue 42)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hybridtron.configs import load_config

PACKAGE = Path(__file__).resolve().parents[2]
# Where deciding on the engine or the pipeline is the module's job: the engines, the layout rules, the DeepSpeed
# config, how a layout is applied (parallelize, the pipeline's stages), and the config itself.
OWNERS = {"train/engine.py", "train/parallel/layout.py", "train/parallel/deepspeed_engine.py",
          "train/parallel/parallelize.py", "train/parallel/pipeline.py"}
# Branches still outside them (none since issue 42). The count may only go down.
LEFT: dict[str, int] = {}


def _engine_branches(tree: ast.AST) -> int:
    """Comparisons that ask which engine or whether there is a pipeline: ``x.engine ==/!= ...``,
    ``engine is (not) None``, ``pipeline is (not) None`` (attributes or names)."""

    def named(node, *names) -> bool:
        return (isinstance(node, ast.Name) and node.id in names) or (isinstance(node, ast.Attribute)
                                                                      and node.attr in names)

    n = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and named(node.left, "engine", "pipeline"):
            none = all(isinstance(c, ast.Constant) and c.value is None for c in node.comparators)
            if (named(node.left, "engine") and any(isinstance(o, (ast.Eq, ast.NotEq)) for o in node.ops)) or none:
                n += 1
    return n


def test_no_code_outside_the_engines_and_the_layout_rules_asks_which_engine_it_runs():
    counts = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.split("/")[0] in ("tests", "configs", "bench", ".venv", ".venv-dev") or rel in OWNERS:
            continue
        if n := _engine_branches(ast.parse(path.read_text())):
            counts[rel] = n
    assert counts == LEFT, counts
    assert "train/trainer.py" not in counts and "train/recipe.py" not in counts


def test_the_branch_counter_finds_branches():
    code = ("if cfg.parallel.engine == 'deepspeed': pass\nx = a if self.pipeline is not None else b\n"
            "if engine is None: pass\nif self.engine.run(): pass\ny = pipeline.stages\n")
    assert _engine_branches(ast.parse(code)) == 3


def test_one_process_gets_the_torch_engine_with_the_parallelized_model_and_its_optimizer():
    import torch

    from hybridtron.train.build import build_model
    from hybridtron.train.engine import DeepSpeedEngine, PipelineEngine, TorchEngine, build_engine
    from hybridtron.train.parallel.mesh import Mesh
    from hybridtron.train.parallel.parallelize import Parallelized

    cfg = load_config("tiny", [("model.n_layers", "2"), ("model.d_model", "64"), ("model.n_heads", "4"),
                               ("model.n_kv_heads", "2")])
    model = build_model(cfg, 256, torch.device("cpu"))
    engine = build_engine(model, cfg, Mesh(), torch.device("cpu"), None)
    assert type(engine) is TorchEngine and not isinstance(engine, (PipelineEngine, DeepSpeedEngine))
    assert engine.model is model and engine.applied == Parallelized() and engine.label == ""
    params = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    assert params == {id(p) for p in model.parameters() if p.requires_grad}
    ids = torch.randint(0, 256, (2, 16))
    batch = {"input_ids": ids, "labels": ids, "doc_ids": torch.zeros_like(ids)}
    loss, aux = engine.run([batch], [None])
    assert loss > 0 and aux == {}
    before = [p.detach().clone() for p in model.parameters()]
    norm, finite = engine.update(loss, lambda _loss, _norm: True)
    assert finite and norm > 0 and all(p.grad is None for p in model.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    held = [p.detach().clone() for p in model.parameters()]
    engine.run([batch], [None])
    norm, finite = engine.update(loss, lambda _loss, _norm: False)  # the spike guard holds the step back
    assert finite and all(torch.equal(a, p) for a, p in zip(held, model.parameters(), strict=True))
    assert engine.update(float("nan"), pytest.fail)[1] is False  # a non-finite loss never asks the guard


def test_the_planner_steps_through_the_engine_of_the_layout(monkeypatch):
    """``hybridtron plan`` runs no step of its own (issue 42, item 3): each planned rank's steps go through the
    engine the trainer would get (train/engine.py ``engine_over``), its ``run`` and its ``update``."""
    import torch

    from hybridtron.train import engine as engine_mod
    from hybridtron.train.plan.memory import fake_modes, fake_world, ready_rank, tracked_step

    calls = []
    for cls in (engine_mod.TorchEngine, engine_mod.PipelineEngine):
        for name in {"run", "update"} & set(vars(cls)):  # (the pipeline's update is the torch engine's)
            def counted(self, *args, _f=getattr(cls, name), _name=name, **kwargs):
                calls.append((type(self).__name__, _name))
                return _f(self, *args, **kwargs)
            monkeypatch.setattr(cls, name, counted)
    small = [("model.n_layers", "2"), ("model.d_model", "64"), ("model.n_heads", "4"), ("model.n_kv_heads", "2"),
             ("data.seq_len", "64"), ("train.micro_batch_size", "2"), ("train.grad_accum_steps", "2")]
    for over, world, engine in (([("parallel.zero_stage", "3")], 2, "TorchEngine"),
                                ([("parallel.pp", "2"), ("parallel.zero_stage", "3")], 4, "PipelineEngine")):
        cfg = load_config("tiny", [*small, *over])
        calls.clear()
        with fake_world(cfg, world, 0) as mesh, fake_modes(cfg):
            rank = ready_rank(cfg, mesh, True, torch.device("cpu"))
            assert type(rank.engine).__name__ == engine and rank.engine.applied.sharded
            tracked_step(rank)
        # the first step (optimizer state made), then the tracked one
        assert calls == [(engine, "run"), (engine, "update")] * 2, (over, calls)
