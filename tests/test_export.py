"""``p2pswarm export``: stage snapshots become a Hugging Face directory that transformers loads as our model.

Snapshots are made as the DiLoCo service makes them (``encode_state`` of the engine's state and the
outer optimizer's), with the live weights moved off the agreed ones, so an export of the live
weights would not match. Errors are one line and exit 1, and a failed write leaves nothing.
"""

from __future__ import annotations

import dataclasses
import errno
import http.server
import json
import re
import threading
from typing import ClassVar

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="the loader of the export (dev extra)")

from p2pswarm import cli  # noqa: E402
from p2pswarm.demo import free_port  # noqa: E402
from p2pswarm.diloco.checkpoint import SnapshotStore, encode_state  # noqa: E402
from p2pswarm.diloco.outer import OuterOptimizer  # noqa: E402
from p2pswarm.errors import ConfigError  # noqa: E402
from p2pswarm.export import fixed_parts, heldout_figure, stage_peers, tokenizer_file  # noqa: E402
from p2pswarm.model import hf_export, hf_files  # noqa: E402
from p2pswarm.model.catalog import get_model  # noqa: E402
from p2pswarm.model.tokenizer import FileTokenizer, train_bpe  # noqa: E402
from p2pswarm.model.transformer import build_model, run_stages  # noqa: E402
from p2pswarm.run.spec import load_run  # noqa: E402

TOLERANCE = 1e-4  # float32 on both sides: only summation order differs
TEXT = "def hello(name):\n    return f'héllo {name}' \x00\n"


def snapshot_state(module, round_: int, tokens: int = 1000) -> dict:
    """A stage's snapshot state as ``DilocoService._make_snapshot`` makes it; the live weights then move on."""
    params = dict(module.named_parameters())
    outer = OuterOptimizer(params)
    outer.rounds = round_
    state = {"format": 1, "model": module.spec.name, "stage": module.stage,
             "engine": {"module": {k: v.clone() for k, v in module.state_dict().items()},
                        "optimizer": torch.optim.AdamW(module.parameters()).state_dict(), "step": 7 * round_,
                        "micro_batches": 3, "tokens": tokens,
                        "subspace": 0 if module.sub_basis is None else module.sub_basis.shape[1]},
             "diloco": outer.state_dict(), "feedback": {}}
    for tensor in state["engine"]["module"].values():  # a replica's own progress since the round: not exported
        tensor.add_(0.5)
    return state


def trained_stages(spec, seed: int = 3, rank: int = 0):
    stages = build_model(spec, seed, rank)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for stage in stages:
            for name, p in stage.named_parameters():  # norms away from 1: a misplaced one would show
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5, generator=generator)
    return stages


def write_snapshots(root, stages, run_identity: str, rounds) -> list:
    dirs = []
    for module, round_ in zip(stages, rounds):
        directory = root / f"{module.spec.name.replace('/', '-')}-{run_identity}-stage{module.stage}"
        store = SnapshotStore(directory)
        store.save(encode_state(snapshot_state(module, max(round_ - 1, 0))), round=max(round_ - 1, 0), step=1)
        store.save(encode_state(snapshot_state(module, round_)), round=round_, step=2)  # the newest is taken
        dirs.append(directory)
    return dirs


def export(*args: str) -> int:
    return cli.main(["export", *args])


def assert_same_logits(out, stages, vocab: int) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, vocab, (2, stages[0].spec.context), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = run_stages(stages, ids), model(input_ids=ids).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= TOLERANCE


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("p2pswarm: error:")]
    assert len(errors) == 1, err
    return errors[0]


@pytest.fixture(scope="module")
def tiny():
    run = load_run("tiny-lm")  # a subspace run (its [wire]): the export folds the projections in
    return run, trained_stages(run.spec(), run.seed, run.subspace)


def test_export_from_snapshot_dirs_loads_in_transformers(tmp_path, tiny, capsys):
    run, stages = tiny
    write_snapshots(tmp_path / "snapshots", stages, run.identity, [4, 5, 4, 5])
    out = tmp_path / "hf"
    assert export("--snapshots", str(tmp_path / "snapshots"), "--out", str(out)) == 0
    assert "wrote" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "generation_config.json",
                                                     "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    assert_same_logits(out, stages, 256)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer(TEXT).input_ids == list(TEXT.encode())
    assert tokenizer.decode(list(TEXT.encode())) == TEXT
    card = (out / "README.md").read_text()
    assert run.identity in card and "stage 1: 5" in card and "tiny-lm" in card and "from_pretrained" in card
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(hf_export.TEMP_PREFIX)]


def test_sharded_beyond_the_shard_size(tmp_path, tiny):
    run, stages = tiny
    snapshots = [hf_export.stage_snapshot(snapshot_state(m, 2), f"stage {m.stage}", run.identity) for m in stages]
    spec = hf_export.check_stages(snapshots)
    card = hf_export.Card(run.identity, run.name, 1000, 1.5, "test", "now", "test")
    written = hf_export.write_export(tmp_path / "hf", spec, snapshots, card, shard_bytes=300_000,
                                     fixed=fixed_parts(run, spec))
    shards = [name for name in written.files if name.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors" not in shards
    index = json.loads((tmp_path / "hf" / hf_export.INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == written.weight_bytes == 4 * sum(p.numel() for s in stages
                                                                            for p in s.parameters())
    assert_same_logits(tmp_path / "hf", stages, 256)


def test_a_bpe_run_exports_its_tokenizer(tmp_path):
    corpus = tmp_path / "text.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200 + TEXT * 50)
    bpe = train_bpe(corpus, 300, tmp_path / "bpe.json", progress=lambda done: None)
    run_file = tmp_path / "run.toml"
    run_file.write_text('name = "bpe"\nmodel = "tiny-lm/2"\ntokenizer = "bpe.json"\n[diloco]\ninner_steps = 4\n')
    run = load_run(str(run_file))
    stages = trained_stages(run.spec(), seed=4)
    write_snapshots(tmp_path / "snapshots", stages, run.identity, [1, 1])
    with pytest.raises(ConfigError, match="--run"):
        tokenizer_file(None, run.vocab)
    out = tmp_path / "hf"
    assert export("--snapshots", *(str(p) for p in (tmp_path / "snapshots").iterdir()), "--out", str(out),
                  "--run", str(run_file)) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer(TEXT).input_ids == FileTokenizer.load(bpe.path).encode(TEXT)
    assert_same_logits(out, stages, run.vocab)


def test_the_byte_tokenizer_ids_are_the_bytes_for_every_byte(tmp_path):
    (tmp_path / "tokenizer.json").write_text(hf_files.byte_tokenizer_json())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(hf_files.tokenizer_config_json(get_model("tiny-lm"))))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = bytes(range(128)).decode() + "é€😀 \t\n  x"
    assert tokenizer(text).input_ids == list(text.encode())


@pytest.mark.parametrize("problem", ["rounds", "missing", "twice", "models"])
def test_incompatible_stages_exit_1_with_one_line(tmp_path, tiny, capsys, problem):
    run, stages = tiny
    rounds = [2, 5, 4, 4] if problem == "rounds" else [4] * 4  # no kept files of stages 0 and 1 within 1
    dirs = write_snapshots(tmp_path / "s", stages, run.identity, rounds)
    if problem == "models":
        other = trained_stages(get_model("tiny-lm/2"))
        dirs = dirs[:2] + write_snapshots(tmp_path / "o", other, run.identity, [4, 4])[1:]
    paths = {"missing": dirs[:3], "twice": dirs + dirs[:1]}.get(problem, dirs)
    assert export("--snapshots", *map(str, paths), "--out", str(tmp_path / "hf")) == 1
    line = one_error_line(capsys)
    assert {"rounds": "more than 1 apart", "missing": "stage(s) 3", "twice": "given twice",
            "models": "different models"}[problem] in line
    assert not (tmp_path / "hf").exists()


def test_older_kept_snapshots_that_fit_the_rule_are_taken(tmp_path, tiny, capsys):
    """Stages snapshot at their own times: the newest files may be 2 rounds apart while kept ones match."""
    run, stages = tiny
    write_snapshots(tmp_path / "s", stages, run.identity, [3, 5, 4, 4])  # kept: {2, 3}, {4, 5}, {3, 4}, {3, 4}
    assert export("--snapshots", str(tmp_path / "s"), "--out", str(tmp_path / "hf")) == 0
    err = capsys.readouterr().err
    assert [int(r) for r in re.findall(r"stage \d from \S+: outer round (\d+)", err)] == [3, 4, 4, 4], err


def test_an_output_dir_that_is_not_empty_needs_force(tmp_path, tiny, capsys):
    run, stages = tiny
    write_snapshots(tmp_path / "s", stages, run.identity, [1] * 4)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert export("--snapshots", str(tmp_path / "s"), "--out", str(out)) == 1
    assert "not empty" in one_error_line(capsys) and (out / "mine.txt").exists()
    assert export("--snapshots", str(tmp_path / "s"), "--out", str(out), "--force") == 0
    assert not (out / "mine.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "s"]  # no temporary directory left


@pytest.mark.parametrize("writer", ["_write_file", "_save_shard"])
def test_a_full_disk_leaves_nothing(tmp_path, tiny, capsys, monkeypatch, writer):
    run, stages = tiny
    write_snapshots(tmp_path / "s", stages, run.identity, [1] * 4)
    real, calls, full_at = getattr(hf_export, writer), [], {"_write_file": 2, "_save_shard": 1}[writer]

    def filling(*args):
        calls.append(args)
        real(*args)  # this file's bytes are on disk, and some files before it
        if len(calls) == full_at:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf_export, writer, filling)
    assert export("--snapshots", str(tmp_path / "s"), "--out", str(tmp_path / "hf")) == 1
    assert "disk is full" in one_error_line(capsys)
    assert len(calls) == full_at and sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_an_unreachable_api_exits_1(tmp_path, capsys):
    assert export("--api", f"127.0.0.1:{free_port()}", "--out", str(tmp_path / "hf")) == 1
    assert "no p2pswarm node answers" in one_error_line(capsys)


class _FakeApi(http.server.BaseHTTPRequestHandler):
    docs: ClassVar[dict] = {}

    def do_GET(self):
        body = json.dumps(self.docs[self.path]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_stage_no_peer_serves_exits_1(tmp_path, capsys):
    peer = {"peer_id": "12D3KooWA", "addrs": ["/ip4/127.0.0.1/tcp/1"], "flags": 16, "outer_round": 2}
    stages = {"model": "tiny-lm/2", "run": "0123456789abcdef", "n_stages": 2,
              "stages": {"0": {"peers": [peer]}, "1": {"peers": [{**peer, "flags": 0}]}}}
    _FakeApi.docs = {"/api/stats": {"role": "bootstrap", "run": None}, "/api/stages": stages}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert export("--api", f"127.0.0.1:{server.server_port}", "--out", str(tmp_path / "hf")) == 1
    finally:
        server.shutdown()
        thread.join()
    assert "stage 1 of tiny-lm/2: no peer serves it" in one_error_line(capsys)
    assert list(stage_peers({**stages, "stages": {**stages["stages"], "1": {"peers": [peer]}}}, "api")) == [0, 1]


def test_export_sends_the_token_a_nodes_api_demands(tmp_path, capsys, monkeypatch):
    """A node whose API is bound beyond loopback demands a token: ``export --api-token`` sends it (issue 25)."""
    from tests.test_api import running_api

    peer = {"peer_id": "12D3KooWA", "addrs": ["/ip4/127.0.0.1/tcp/1"], "flags": 16, "outer_round": 2}
    stages = {"model": "tiny-lm/2", "run": "0123456789abcdef", "n_stages": 2, "stages": {"0": {"peers": [peer]}}}

    async def stats_doc(params: dict) -> dict:
        return {"role": "bootstrap", "run": None}

    async def stages_doc(params: dict) -> dict:
        return stages

    monkeypatch.delenv("P2PSWARM_API_TOKEN", raising=False)
    with running_api({"/api/stats": stats_doc, "/api/stages": stages_doc}, token="s3cret") as address:
        out = str(tmp_path / "hf")
        assert export("--api", address, "--out", out) == 1
        assert "--api-token" in one_error_line(capsys)  # the node's 401, in one line
        assert export("--api", address, "--out", out, "--api-token", "s3cret") == 1
        assert "stage 1 of tiny-lm/2: no peer serves it" in one_error_line(capsys)  # past the token


def test_the_heldout_figure_is_the_exported_rounds():
    swarm = {"heldout_by_round": [{"outer_round": 3, "bpb": 2.5, "chains": 2}],
             "heldout": [{"rounds": [3, 4], "bpb": 2.0, "complete": True},
                         {"rounds": [3, 4], "bpb": 2.2, "complete": True},
                         {"rounds": [3, 4], "bpb": 9.0, "complete": False}]}
    assert heldout_figure(swarm, [3, 3])[0] == 2.5
    assert heldout_figure(swarm, [3, 4])[0] == pytest.approx(2.1)
    assert heldout_figure(swarm, [4, 4])[0] is None
    assert heldout_figure(None, [3, 3])[0] is None


def test_the_vocabulary_comes_from_the_weights(tiny):
    run, _stages = tiny
    spec = dataclasses.replace(run.spec(), vocab=300)
    snapshots = [hf_export.stage_snapshot(snapshot_state(m, 1), "s") for m in build_model(spec, 0)]
    assert hf_export.check_stages(snapshots).vocab == 300
    one = get_model("tiny-lm/1")
    assert hf_export.check_stages([hf_export.stage_snapshot(snapshot_state(build_model(one, 0)[0], 1), "s")]).vocab \
        == 256


def test_export_tries_the_peers_its_node_counts_as_working_before_a_higher_claimed_round():
    from p2pswarm.dht.records import FLAG_SNAPSHOT

    def peer(name: str, round_: int, working: bool) -> dict:
        return {"peer_id": name, "addrs": [f"/ip4/127.0.0.1/tcp/{round_ + 1}"], "flags": FLAG_SNAPSHOT,
                "outer_round": round_, "working": working}

    stages = {"model": "tiny-lm/1", "n_stages": 1, "stages": {"0": {"peers": [
        peer("claimer", 99, False), peer("old", 3, True), peer("new", 5, True)]}}}
    assert [name for name, _ in stage_peers(stages, "api")[0]] == ["new", "old", "claimer"]


def test_a_subspace_run_exports_a_plain_llama_with_its_projections_folded_in(tmp_path, capsys):
    """A subspace model (model/subspace.py) needs its run file: with it, transformers computes our logits."""
    path = tmp_path / "sub.toml"
    path.write_text('name = "sub"\nmodel = "tiny-lm/2"\nseed = 3\n[wire]\nsubspace = 16\n')
    run = load_run(str(path))
    stages = build_model(run.spec(), run.seed, run.subspace)
    with torch.no_grad():
        for stage in stages:  # away from the start, out of the span too: as AdamW leaves them
            for p in stage.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    for module in stages:
        directory = tmp_path / "snapshots" / f"tiny-lm-2-{run.identity}-stage{module.stage}"
        state = snapshot_state(module, 1)
        state["engine"]["subspace"] = run.subspace
        SnapshotStore(directory).save(encode_state(state), round=1, step=1)
    assert export("--snapshots", str(tmp_path / "snapshots"), "--out", str(tmp_path / "bare")) == 1
    assert "constrained to 16 directions" in one_error_line(capsys)
    out = tmp_path / "hf"
    assert export("--snapshots", str(tmp_path / "snapshots"), "--out", str(out), "--run", str(path)) == 0
    assert_same_logits(out, stages, 256)
