"""Run files: parsing, the identity, the packaged runs, ``join --run``, and peers of other runs refused."""

from __future__ import annotations

import dataclasses
import logging
import re
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pswarm.cli import build_parser, config_from_args
from p2pswarm.errors import ConfigError
from p2pswarm.model.catalog import default_rows, get_model
from p2pswarm.node.config import NodeConfig, Role
from p2pswarm.run.diloco import DilocoSettings
from p2pswarm.run.spec import DEFAULT_RUN, IDENTITY_CHARS, default_run, load_run, packaged_runs, parse_run, run_for_join
from p2pswarm.run.training import TrainConfig, train_config

FULL = """
name = "test"
model = "tiny-lm/2"
seed = 3
tokenizer = "bytes"

[optimizer]
lr = 1e-3
betas = [0.9, 0.95]
eps = 1e-8
weight_decay = 0.1
grad_clip = 1.0
accumulate = 2
warmup_steps = 10
decay_steps = 100
min_lr_ratio = 0.1

[batch]
rows = 4
context = 64
dtype = "bfloat16"
eval_batches = 4

[diloco]
inner_steps = 50
outer_lr = 0.7
momentum = 0.9
codec = "int8"
aggregator = "mean"
"""

REORDERED = """
# the same run, keys in another order, other spellings, comments
tokenizer = "bytes"   # bytes
seed = 3
model = "tiny-lm/2"
name = "another name: names are for humans"

[diloco]
aggregator = "mean"
codec = "int8"
momentum = 0.9
outer_lr = 0.7
inner_steps = 50

[batch]
dtype = "bfloat16"
eval_batches = 4  # the held-out set
context = 64
rows = 4

[optimizer]
min_lr_ratio = 0.1
decay_steps = 100
warmup_steps = 10
accumulate = 2
grad_clip = 1        # an integer where a number is asked: the same value
weight_decay = 0.1
eps = 0.00000001
betas = [0.9, 0.95]
lr = 0.001
"""


def parse(text: str):
    return parse_run(text, "t.toml", base_dir=None)


def test_every_packaged_run_loads_and_fits_its_model():
    names = packaged_runs()
    assert {"tiny-lm", "nano", "micro", "small", "medium", "large", "xl"} <= set(names)
    identities = set()
    for name in names:
        run = load_run(name)
        spec = run.spec()
        assert run.name == name and re.fullmatch(f"[0-9a-f]{{{IDENTITY_CHARS}}}", run.identity)
        assert run.context <= spec.context and run.vocab == spec.vocab == 256
        if name != "tiny-lm":
            assert run.dtype == "bfloat16" and run.warmup_steps >= 1000 and run.decay_steps > run.warmup_steps
            assert run.rows == default_rows(get_model(run.model))
        identities.add(run.identity)
    assert len(identities) == len(names)


def test_the_default_run_is_todays_tiny_lm_behaviour():

    run = default_run()
    assert run.name == DEFAULT_RUN and run.model == "tiny-lm" and run.lr == TrainConfig().lr
    assert (run.betas, run.weight_decay, run.grad_clip) == (TrainConfig().betas, TrainConfig().weight_decay,
                                                            TrainConfig().grad_clip)
    assert (run.rows, run.context, run.dtype) == (8, 128, "float32") and run.warmup_steps == run.decay_steps == 0
    assert (run.subspace, run.activations, run.gradients) == (16, "q4", "q4")  # the home line's best boundary
    assert run.eval_batches == 8 == train_config(run).eval_batches  # the held-out set as it always was
    assert run.diloco() == DilocoSettings()
    assert train_config(run).lr == run.lr
    assert NodeConfig(role=Role.JOIN).run.identity == run.identity


def test_identity_is_stable_under_order_comments_and_spelling():
    a, b = parse(FULL), parse(REORDERED)
    assert a.identity == b.identity and a.name != b.name
    assert len(a.identity) == IDENTITY_CHARS and a.run_bytes == bytes.fromhex(a.identity)


def _toml(tables: list[tuple[str, list[str]]]) -> str:
    return "\n".join((f"[{name}]\n" if name else "") + "\n".join(lines) + "\n" for name, lines in tables)


def _sections(text: str) -> list[tuple[str, list[str]]]:
    sections = [("", [])]
    for line in text.strip().splitlines():
        if line.startswith("["):
            sections.append((line.strip("[]"), []))
        elif line:
            sections[-1][1].append(line)
    return sections


@given(st.randoms(use_true_random=False))
def test_identity_is_the_same_in_any_key_and_table_order(rng):
    sections = _sections(FULL)
    top, tables = sections[0], sections[1:]
    rng.shuffle(tables)
    for _, lines in [top, *tables]:
        rng.shuffle(lines)
    assert parse(_toml([top, *tables])).identity == parse(FULL).identity


CHANGES = [("seed = 3", "seed = 4"), ('model = "tiny-lm/2"', 'model = "tiny-lm/4"'), ("lr = 1e-3", "lr = 2e-3"),
           ("betas = [0.9, 0.95]", "betas = [0.9, 0.99]"), ("eps = 1e-8", "eps = 1e-6"),
           ("weight_decay = 0.1", "weight_decay = 0.0"), ("grad_clip = 1.0", "grad_clip = 0.5"),
           ("accumulate = 2", "accumulate = 1"), ("warmup_steps = 10", "warmup_steps = 11"),
           ("decay_steps = 100", "decay_steps = 0"), ("min_lr_ratio = 0.1", "min_lr_ratio = 0.0"),
           ("rows = 4", "rows = 5"), ("context = 64", "context = 65"), ('dtype = "bfloat16"', 'dtype = "float32"'),
           ("eval_batches = 4", "eval_batches = 3"),
           ("inner_steps = 50", "inner_steps = 51"), ("outer_lr = 0.7", "outer_lr = 0.8"),
           ("momentum = 0.9", "momentum = 0.8"), ('codec = "int8"', 'codec = "float16"'),
           ('aggregator = "mean"', 'aggregator = "median"'),
           ('aggregator = "mean"', 'aggregator = "mean"\nfragments = 2')]


@pytest.mark.parametrize(("old", "new"), CHANGES)
def test_any_changed_value_changes_the_identity(old, new):
    assert FULL.count(old) == 1
    assert parse(FULL.replace(old, new)).identity != parse(FULL).identity


def test_the_tokenizer_is_part_of_the_identity_and_sets_the_vocabulary(tmp_path):
    from tokenizers import Tokenizer, models

    for name, vocab in (("a.json", {"a": 0, "b": 1, "[UNK]": 2}), ("b.json", {"a": 0, "c": 1, "[UNK]": 2, "d": 3})):
        Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(tmp_path / name))
    path = tmp_path / "run.toml"
    path.write_text(FULL.replace('tokenizer = "bytes"', 'tokenizer = "a.json"'))
    first = load_run(str(path))
    assert first.vocab == 3 == first.spec().vocab and first.tokenizer == str(tmp_path / "a.json")
    path.write_text(FULL.replace('tokenizer = "bytes"', 'tokenizer = "b.json"'))
    second = load_run(str(path))
    assert second.vocab == 4 and len({first.identity, second.identity, parse(FULL).identity}) == 3


BAD = [
    ("name = ", "not valid TOML"),
    (FULL + "\nlr = 1.0\n", "lr: unknown key"),
    (FULL + "\n[extra]\nx = 1\n", "extra: unknown key"),
    (FULL.replace("rows = 4", "rows = 4\ncolumns = 3"), "batch.columns: unknown key"),
    (FULL.replace("[optimizer]", "[optimiser]"), "optimiser: unknown key"),
    (FULL.replace('name = "test"', ""), "name: missing"),
    (FULL.replace('model = "tiny-lm/2"', 'model = "nope"'), "model: unknown model"),
    (FULL.replace('model = "tiny-lm/2"', 'model = "tiny-lm/5"'), "model:"),
    (FULL.replace("seed = 3", 'seed = "3"'), "seed: must be an integer"),
    (FULL.replace("seed = 3", "seed = true"), "seed: must be an integer"),
    (FULL.replace("rows = 4", "rows = 4.0"), "batch.rows: must be an integer"),
    (FULL.replace("lr = 1e-3", 'lr = "fast"'), "optimizer.lr: must be a number"),
    (FULL.replace("lr = 1e-3", "lr = nan"), "optimizer.lr: must be a finite number"),
    (FULL.replace("lr = 1e-3", "lr = 0.0"), "optimizer.lr: must be within"),
    (FULL.replace("betas = [0.9, 0.95]", "betas = [0.9]"), "optimizer.betas"),
    (FULL.replace("betas = [0.9, 0.95]", "betas = 0.9"), "optimizer.betas: must be an array"),
    (FULL.replace("rows = 4", "rows = 0"), "batch.rows: must be within"),
    (FULL.replace("context = 64", "context = 129"), "batch.context: must be within [1, 128]"),
    (FULL.replace('dtype = "bfloat16"', 'dtype = "int8"'), "batch.dtype: must be one of"),
    (FULL.replace("eval_batches = 4", "eval_batches = 0"), "batch.eval_batches: must be within [1, 8]"),
    (FULL.replace("eval_batches = 4", "eval_batches = 9"), "batch.eval_batches: must be within [1, 8]"),
    (FULL.replace("warmup_steps = 10", "warmup_steps = -1"), "optimizer.warmup_steps"),
    (FULL.replace("min_lr_ratio = 0.1", "min_lr_ratio = 1.5"), "optimizer.min_lr_ratio"),
    (FULL.replace("inner_steps = 50", "inner_steps = 0"), "diloco.inner_steps"),
    (FULL.replace("momentum = 0.9", "momentum = 1.0"), "diloco.momentum"),
    (FULL.replace('codec = "int8"', 'codec = "zip"'), "diloco.codec"),
    (FULL.replace('codec = "int8"', 'codec = "sparse"').replace('aggregator = "mean"', 'aggregator = "median"'),
     "diloco.codec: --codec sparse needs --aggregator mean or chunk_clip"),
    (FULL.replace('aggregator = "mean"', 'aggregator = "mean"\nfragments = 0'), "diloco.fragments: --fragments"),
    (FULL.replace('aggregator = "mean"', 'aggregator = "mean"\nfragments = 51'), "at most --inner-steps (50)"),
    ("diloco = 3\n" + FULL.replace("[diloco]", "[x]"), "diloco: must be a table"),
    (FULL.replace('tokenizer = "bytes"', 'tokenizer = "missing.json"'), "tokenizer:"),
]


@pytest.mark.parametrize(("text", "words"), BAD, ids=[words for _, words in BAD])
def test_a_bad_run_file_is_one_config_error_naming_the_file_and_key(text, words):
    with pytest.raises(ConfigError) as error:
        parse(text)
    message = str(error.value)
    assert "\n" not in message and message.startswith("run file t.toml: ") and words in message, message


def test_one_fragment_is_the_identity_runs_had_before_fragments():
    assert parse(FULL.replace('aggregator = "mean"', 'aggregator = "mean"\nfragments = 1')).identity == \
        parse(FULL).identity
    run = parse(FULL.replace('aggregator = "mean"', 'aggregator = "mean"\nfragments = 5'))
    assert run.diloco().fragments == 5 and run.diloco().problem() is None


def test_a_micro_batch_too_big_for_one_frame_is_refused():
    pytest.importorskip("p2pswarm.run.plan")
    text = FULL.replace('model = "tiny-lm/2"', 'model = "xl"').replace("context = 64", "context = 1024")
    with pytest.raises(ConfigError, match=r"batch\.rows"):
        parse(text.replace("rows = 4", "rows = 256").replace('dtype = "bfloat16"', 'dtype = "float32"'))


def test_load_run_by_name_and_by_path(tmp_path):
    assert load_run("tiny-lm") == default_run()
    path = tmp_path / "mine.toml"
    path.write_text(FULL)
    assert load_run(str(path)).identity == parse(FULL).identity
    with pytest.raises(ConfigError, match="unknown run 'nope'"):
        load_run("nope")
    with pytest.raises(ConfigError, match="cannot read"):
        load_run(str(tmp_path / "absent.toml"))


def test_join_without_run_is_the_default_run_on_model_and_flags():
    assert run_for_join(None, None, {}).identity == default_run().identity
    assert run_for_join(None, "tiny-lm", {"inner_steps": None}).identity == default_run().identity
    cut = run_for_join(None, "tiny-lm/2", {})
    assert cut.model == "tiny-lm/2" and cut.lr == default_run().lr and cut.identity != default_run().identity
    fast = run_for_join(None, None, {"inner_steps": 40})
    assert fast.inner_steps == 40 and fast.identity != default_run().identity
    config = config_from_args(build_parser().parse_args(
        ["join", "--bootstrap", BOOT, "--model", "tiny-lm/2", "--inner-steps", "40"]))
    assert config.run.identity == run_for_join(None, "tiny-lm/2", {"inner_steps": 40}).identity
    assert config.training.diloco.inner_steps == 40  # merged into our DiLoCo settings once, by the CLI


def test_join_with_run_refuses_another_model_and_the_flags_it_fixes():
    assert run_for_join("nano", "nano", {}).name == "nano"
    with pytest.raises(ConfigError, match="--model tiny-lm is not the model of run nano"):
        run_for_join("nano", "tiny-lm", {})
    with pytest.raises(ConfigError, match="--outer-momentum is fixed by the run"):
        run_for_join("nano", None, {"momentum": 0.5})


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2pswarm", *args], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


BOOT = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGRUVh7tM5gZ1mWG1jGkNhVVpR8pyR7H5RHmQVmoyVNYb"


def test_cli_join_with_a_bad_run_file_exits_1_with_one_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(FULL.replace("rows = 4", "rows = 4\ncolour = 1"))
    for args in (("--run", str(path)), ("--run", "tiny-lm", "--model", "nano"),
                 ("--run", "nano", "--inner-steps", "5")):
        result = cli("join", "--bootstrap", BOOT, *args)
        lines = [line for line in result.stderr.splitlines() if line.startswith("p2pswarm: error:")]
        assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"run file {path}: batch.colour: unknown key" in cli("join", "--bootstrap", BOOT, "--run", str(path)).stderr


def test_cli_models_lists_the_packaged_runs_and_resolves_one():
    result = cli("models")
    assert result.returncode == 0, result.stderr
    for name in packaged_runs():
        assert load_run(name).identity in result.stdout
    one = cli("models", "--run", "nano")
    assert one.returncode == 0 and load_run("nano").identity in one.stdout and "bfloat16" in one.stdout


def test_a_last_stage_closes_held_out_rounds_at_its_runs_size():
    """A run's ``[batch] eval_batches`` is what stage 0 sends each round and what the last stage waits for
    before a held-out round is complete."""
    pytest.importorskip("torch")
    import trio

    from p2pswarm.swarm.service import SwarmService

    run = load_run("tiny-lm").with_values(model="tiny-lm/2", eval_batches=3)

    async def main():
        svc = SwarmService(spec=run.spec(), stage=1, me="peer-1", pool=None, stage_map=None, host=None,
                           config=train_config(run), run=run)
        assert svc.evals.expected == 3 == svc.config.eval_batches
        feeder = SwarmService(spec=run.spec(), stage=0, me="peer-0", pool=None, stage_map=None, host=None,
                              config=train_config(run), run=run).feeder
        held = feeder.held_out_set(feeder.load_corpus())  # what stage 0 sends each round: as many
        assert len(held) == 3 and all(len(batch.rows) == 32 for batch in held)

    trio.run(main)


def test_a_peer_of_another_run_has_its_tensors_refused_once_logged(caplog):
    """Two services of different runs: a forward made by one is refused by the other, not computed,
    not banned, and logged once per peer."""
    pytest.importorskip("torch")
    import trio

    from p2pswarm import wire
    from p2pswarm.swarm import engine as eng
    from p2pswarm.swarm.activation import Ack
    from p2pswarm.swarm.service import Job, SwarmService

    ours = load_run("tiny-lm").with_values(model="tiny-lm/2")
    theirs = ours.with_values(lr=1e-3)

    def service(run, stage):
        return SwarmService(spec=run.spec(), stage=stage, me=f"peer-{stage}", pool=None, stage_map=None, host=None,
                            config=train_config(run), run=run)

    async def main():
        sender, receiver, friend = service(theirs, 0), service(ours, 1), service(ours, 0)
        for svc in (sender, friend):
            svc.engine = eng.StageEngine(svc.spec, 0, svc.config)
        ids = eng.ids_tensor([bytes(range(i, i + 9)) for i in range(2)])
        work = eng.Work("forward", (b"s" * 16, 0), ids[:, :-1], ids[:, 1:].contiguous())
        (send,), _ = sender._compute(Job(work, None))
        assert send.message.run == theirs.run_bytes
        with caplog.at_level(logging.WARNING):
            for _ in range(2):
                reply = await receiver._on_frame("12D3KooWthem", send.message, send.payload)
                assert isinstance(reply, wire.ErrorReply) and reply.code == "other-run"
        refusals = [r.getMessage() for r in caplog.records if "refusing its tensors" in r.getMessage()]
        assert refusals == [f"peer 12D3KooWthem is training run {theirs.identity}, we train run {ours.identity} "
                            f"(tiny-lm): refusing its tensors (peers must train the same run: the same --run file, "
                            "or the same model and DiLoCo flags)"]
        assert len(receiver.inbound) == 0 and receiver.counts["other_run_frames"] == 2
        assert receiver.counts["garbage_frames"] == 0 and not receiver._banned
        (good,), _ = friend._compute(Job(dataclasses.replace(work, key=(b"t" * 16, 0)), None))
        assert await receiver._on_frame("12D3KooWfriend", good.message, good.payload) == Ack(0, 1)

    trio.run(main)


def test_a_replica_of_another_run_is_never_met(caplog):
    """DiLoCo: a Hello of another run is not ours (logged once per peer); snapshots are per run too."""
    pytest.importorskip("torch")
    from p2pswarm.diloco import messages as msgs
    from p2pswarm.diloco.service import DilocoService

    ours = load_run("tiny-lm")
    theirs = ours.with_values(seed=1)
    service = DilocoService(settings=ours.diloco(), spec=ours.spec(), stage=0, me="me", pool=None, stage_map=None,
                            run=ours)
    assert service.server.run == ours.run_bytes == service.run_id
    hello = msgs.Hello(0, 0, 10, "int8", True, False, ("them",), theirs.run_bytes)
    with caplog.at_level(logging.WARNING):
        assert not service._our_run("them", hello) and not service._our_run("them", hello)
    assert service._our_run("friend", dataclasses.replace(hello, run=ours.run_bytes))
    assert [r.getMessage() for r in caplog.records if "outer rounds" in r.getMessage()] == [
        f"peer them is training run {theirs.identity}, we train run {ours.identity}: refusing its outer rounds "
        "(replicas must train the same run: the same --run file, or the same model and DiLoCo flags)"]
