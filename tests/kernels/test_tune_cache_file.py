"""The tuner's cache file (kernels/tune.py, ``kernel_choices.json``) as found on disk: valid JSON whose entries have
the wrong shape (a hand edit, another program, a version that wrote something else) is dropped entry by entry with
one warning naming the file and what went, and measured again, while the good entries beside it are kept, through
``auto`` (`backend.pick`) and through ``hybridtron kernels``; and the file stays bounded, least recently used first,
keeping what this machine uses."""

from __future__ import annotations

import json
import warnings

import pytest

from hybridtron.cli import main
from hybridtron.kernels import backend, tune

from .test_kernels_command import SMALL
from .test_tune import SHAPE, fake_tuner

OTHER_MACHINE = "0123456789abcdef"  # another GPU's fingerprint hash, sharing the home directory
GOOD = {"chosen": "flex", "times_ms": {"flex": 0.5, "sdpa": 1.0}, "dropped": {}, "measured": "2026-01-01T00:00:00+00:00"}


def other_shape(t: int) -> tuple:
    return (SHAPE[0], tuple((k, t if k == "T" else v) for k, v in SHAPE[1]))


SDPA = {**GOOD, "chosen": "sdpa"}
GOOD_KEY = tune.shape_key(other_shape(128))
KEY = tune.shape_key(SHAPE)

# name -> how it spoils this machine's entry (machines, this machine's hash, the spoiled shape key); "entry" cases
# spoil the machine entry itself, so only the other machine's entry is left to keep
SPOILED = {
    "machine is a string": ("entry", lambda m, fp, k: m.__setitem__(fp, "RTX 4090")),
    "decisions is a list": ("entry", lambda m, fp, k: m[fp].__setitem__("decisions", [m[fp]["decisions"]])),
    "decision without chosen": ("decision", lambda m, fp, k: m[fp]["decisions"][k].pop("chosen")),
    "backend that does not exist": ("decision", lambda m, fp, k: m[fp]["decisions"][k].update(chosen="warp-drive")),
    "time that is not a number": ("decision", lambda m, fp, k: m[fp]["decisions"][k]["times_ms"].update(reference="1 ms")),
    "decision is a list": ("decision", lambda m, fp, k: m[fp]["decisions"].__setitem__(k, ["reference"])),
    "time is NaN": ("decision", lambda m, fp, k: m[fp]["decisions"][k]["times_ms"].update(reference=float("nan"))),
    "dropped is a list": ("decision", lambda m, fp, k: m[fp]["decisions"][k].update(dropped=["flex"])),
    "chosen is a number": ("decision", lambda m, fp, k: m[fp]["decisions"][k].update(chosen=3)),
}


def spoiled_cache(path, how: str, device_type: str, key: str, good_key: str, good: dict = GOOD,
                  rest: dict | None = None) -> None:
    """A cache holding a ``good`` decision of this machine (``good_key``), another machine's entry, and ``key``'s
    decision spoiled as ``SPOILED[how]`` says (and this machine's decisions ``rest``)."""
    fp = tune._fingerprint_hash(device_type)
    spoiled = {"chosen": "reference", "times_ms": {"reference": 9.0}, "dropped": {}, "measured": GOOD["measured"]}
    machines = {OTHER_MACHINE: {"machine": {"device": "cuda", "gpu": "other"}, "decisions": {good_key: dict(good)}},
                fp: {"machine": tune.fingerprint(device_type),
                     "decisions": {**(rest or {}), good_key: dict(good), key: spoiled}}}
    SPOILED[how][1](machines, fp, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": tune.FORMAT, "machines": machines}))


def tuning_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, tune.KernelTuningWarning)]


@pytest.fixture
def tuned(tmp_path):
    with fake_tuner(tmp_path) as log:
        yield log


@pytest.mark.parametrize("how", list(SPOILED))
def test_a_malformed_entry_is_dropped_with_one_warning_and_measured_again(how, tuned):
    path = tune.cache_path()
    spoiled_cache(path, how, "cpu", KEY, GOOD_KEY)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert backend.pick("attention", "auto", "cpu", SHAPE) == "sdpa"  # measured: 1.0 ms of 3.0 / 1.0 / 2.0
        good = backend.pick("attention", "auto", "cpu", other_shape(128))
    said = tuning_warnings(caught)
    assert len(said) == 1, said
    assert said[0].startswith(f"kernels: dropped 1 malformed entry of the tuner's cache {path}: "), said
    whole = SPOILED[how][0] == "entry"  # this machine's entry went whole: its good class is measured again too
    assert tuned == [["flex", "sdpa", "triton"]] * (2 if whole else 1)  # else the spoiled class alone
    machines = json.loads(path.read_text())["machines"]
    fp = tune._fingerprint_hash("cpu")
    assert machines[OTHER_MACHINE]["decisions"] == {GOOD_KEY: GOOD}  # the good entries beside it are kept
    assert machines[fp]["decisions"][KEY]["chosen"] == "sdpa"  # rewritten well formed
    if not whole:
        assert good == "flex" and tune.decisions()[GOOD_KEY].note == "cache"  # this machine's good one: kept, used
        assert machines[fp]["decisions"][GOOD_KEY] == GOOD


@pytest.mark.parametrize("how", ["machine is a string", "decisions is a list", "decision without chosen",
                                 "backend that does not exist", "time that is not a number"])
def test_hybridtron_kernels_with_a_malformed_cache(how, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HYBRIDTRON_CACHE_DIR", str(tmp_path / "cache"))
    tune.reset()
    backend.clear_cache()
    measured: list[str] = []

    def measure(op, shape, device, only=None):  # the reference everywhere: the command's own forward stays fast
        measured.append(tune.shape_key(shape))
        return tune.Decision("reference", {"reference": 1.0}, measured="2026-01-01T00:00:00+00:00")

    monkeypatch.setattr(tune, "measure", measure)
    argv = ["kernels", "--config", "tiny_hybrid", "--measure-on-cpu", *SMALL]
    try:
        assert main(argv) == 0  # the classes the preset meets
        keys = sorted(measured)
        attention = [k for k in keys if k.startswith("attention[") and "grad=True" in k][0]
        bad = [k for k in keys if k.startswith("delta_rule[") and "grad=True" in k][0]
        rest = json.loads(tune.cache_path().read_text())["machines"][tune._fingerprint_hash("cpu")]["decisions"]
        spoiled_cache(tune.cache_path(), how, "cpu", bad, attention, SDPA, rest)  # sdpa: runs a backward here
        tune.reset()
        backend.clear_cache()
        measured.clear()
        capsys.readouterr()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            code = main(argv)
        out, err = capsys.readouterr()
    finally:
        tune.reset()
        backend.clear_cache()
    assert code == 0 and "Traceback" not in err, err
    said = tuning_warnings(caught)
    assert len(said) == 1 and str(tune.cache_path()) in said[0] and "malformed" in said[0], said
    if SPOILED[how][0] == "decision":
        assert measured == [bad]  # the spoiled class measured again, the others from the cache
        assert f"| {attention.split('[', 1)[1].rstrip(']')} | sdpa (cache) |" in out  # the good one beside it, used
    else:
        assert bad in measured and attention in measured  # this machine's entry went whole
    machines = json.loads(tune.cache_path().read_text())["machines"]
    assert machines[OTHER_MACHINE]["decisions"] == {attention: SDPA}


def test_the_cache_is_bounded_and_keeps_what_this_machine_uses(tuned, monkeypatch):
    monkeypatch.setattr(tune, "MAX_DECISIONS", 4)
    monkeypatch.setattr(tune, "MAX_MACHINES", 2)
    fp = tune._fingerprint_hash("cpu")
    path = tune.cache_path()
    old = {tune.shape_key(other_shape(1000 + i)): dict(GOOD) for i in range(6)}  # measured long ago, never used since
    used = tune.shape_key(other_shape(128))
    machines = {f"{i:016x}": {"machine": {}, "decisions": dict(old)} for i in range(3)}  # other GPUs, older
    machines[fp] = {"machine": tune.fingerprint("cpu"), "decisions": {used: dict(GOOD), **old}}
    path.write_text(json.dumps({"format": tune.FORMAT, "machines": machines}))
    assert backend.pick("attention", "auto", "cpu", other_shape(128)) == "flex"  # used from the file: oldest there
    for t in (2048, 4096, 8192):  # three new classes measured and stored
        assert backend.pick("attention", "auto", "cpu", other_shape(t)) == "sdpa"
    saved = json.loads(path.read_text())["machines"]
    assert len(saved) == 2 and fp in saved and list(saved)[-1] == fp  # this machine, and the latest other one
    assert all(len(m["decisions"]) <= 4 for m in saved.values())
    assert list(saved[fp]["decisions"]) == [used] + [tune.shape_key(other_shape(t)) for t in (2048, 4096, 8192)]
    # (the old ones this process never used went first, least recently used first)
    size = path.stat().st_size
    for t in range(20):  # many more classes: the file does not grow past its bound
        backend.pick("attention", "auto", "cpu", other_shape(16384 + t))
    assert len(json.loads(path.read_text())["machines"][fp]["decisions"]) == 4
    assert path.stat().st_size <= size * 1.1
