"""The CLI's ``inspect`` (--format json with --verify, --timings without a GPU and with options it
does not take), ``make-checkpoint`` (refuses a non-empty --out unless --force, never leaves a half-written
checkpoint, names the path once), and the errors of a --model directory whose config.json is empty, not an
object or not JSON. Run through click's CliRunner on the tiny preset."""
from __future__ import annotations

import json

import pytest

from host.errors import ExecutorUnavailable, ModelLoadError
from host.executors import gpu_available
from loader.config import REQUIRED_FIELDS, ConfigError, ModelConfig, preset
from tests.helpers import run


# ---------------------------------------------------------------------------------------------- inspect
INSPECT = ["inspect", "--preset", "tiny", "--sms", "3", "--layer-limit", "4"]  # layer 3: attention


def test_inspect_json_keeps_the_verifier_result_and_the_context():
    plain = run([*INSPECT, "--format", "json"])
    assert plain.exit_code == 0, plain.output
    base = json.loads(plain.output)
    r = run([*INSPECT, "--format", "json", "--verify", "--context", "100"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert set(d) == set(base)  # the existing keys, still valid JSON
    st = d["stats"]
    assert st["verified"] == {"instructions": st["instructions"], "waits": st["waits"],
                              "counters": st["counters"], "steps": 2}
    assert st["bytes_total"] > base["stats"]["bytes_total"]  # --context adds the attention KV bytes
    assert "verified" not in base["stats"]
    # the stats line of the other formats holds the same object
    s = run([*INSPECT, "--format", "stats", "--verify", "--context", "100"])
    assert s.exit_code == 0 and json.loads(s.output.splitlines()[0][len("# stats "):]) == st


def _dump(out: str) -> tuple[dict, dict]:
    d = json.loads(out)
    return d, d.pop("options")


def test_inspect_json_without_verify_is_the_program_dump():
    """Without options, the dump is the program the megakernel runs (assembler.options.PROGRAM: the runner's
    build_program + split_gdn), with the options it used; a given option changes only that option."""
    from assembler.graph import verify_graph
    from assembler.options import PROGRAM
    from assembler.scheduler import schedule
    from megakernel.runner import build_program, split_gdn
    cfg = preset("tiny")
    r = run(["inspect", "--preset", "tiny", "--sms", "7", "--format", "json"])
    assert r.exit_code == 0, r.output
    d, opts = _dump(r.output)
    gpu = split_gdn(build_program(cfg, 1, 7), cfg.gdn_head_group)
    assert d == json.loads(gpu.to_json())
    assert opts == PROGRAM.for_rows(1).as_dict(cfg) == {"fuse_reduce": False, "defer_reduce": True,
                                                         "local_reduce": True, "mlp_groups": False, "gdn_split": 3}
    r = run(["inspect", "--preset", "tiny", "--sms", "7", "--format", "json", "--no-defer-reduce", "--gdn-split", "1"])
    assert r.exit_code == 0, r.output
    d, opts = _dump(r.output)
    assert d == json.loads(schedule(verify_graph(cfg, 1, None, False), 7, False).to_json())
    assert opts["defer_reduce"] is False and opts["gdn_split"] == 1 and opts["fuse_reduce"] is False
    assert d != json.loads(gpu.to_json())  # negative control: the options reach the program


@pytest.mark.parametrize("extra", [[], ["--format", "json"], ["--context", "5", "--sms", "3"]],
                         ids=["plain", "format-json", "context"])
def test_inspect_timings_without_gpu_is_a_clean_error(extra):
    if gpu_available()[0]:
        pytest.skip("a GPU is present")
    r = run(["inspect", "--timings", *extra])
    assert r.exit_code == ExecutorUnavailable.exit_code, r.output
    assert "--timings runs the megakernel and needs an NVIDIA GPU" in r.output
    assert isinstance(r.exception, SystemExit) and "Traceback" not in r.output


@pytest.mark.parametrize("extra,named", [
    (["--format", "stats"], "--format stats"),
    (["--format", "text"], "--format text"),
    (["--verify"], "--verify"),
    (["--no-fuse-reduce"], "--no-fuse-reduce"),
    (["--rows", "2", "--kind", "mtp"], "--rows, --kind"),
    (["--layer-limit", "0"], "--layer-limit"),
    (["--gdn-split", "2"], "--gdn-split"),
])
def test_inspect_timings_refuses_the_options_it_ignores(extra, named):
    """--timings runs the megakernel's own default program: program-shaping options are a usage error (exit 2),
    checked before the GPU."""
    r = run(["inspect", "--timings", *extra])
    assert r.exit_code == 2, r.output
    assert f"does not take {named}" in r.output and "Traceback" not in r.output


def test_inspect_gdn_split_shows_and_verifies_the_runners_program():
    """--gdn-split K: the program the megakernel runner runs (GDN steps split over value heads), verified
    statically; more parts than value heads per key head is a usage error naming the option."""
    base = run(["inspect", "--preset", "tiny", "--sms", "7", "--format", "stats", "--gdn-split", "1"])
    r = run(["inspect", "--preset", "tiny", "--sms", "7", "--format", "stats", "--gdn-split", "3", "--verify"])
    assert base.exit_code == 0 and r.exit_code == 0, r.output
    st0 = json.loads(base.output.splitlines()[0].removeprefix("# stats "))
    st = json.loads(r.output.splitlines()[0].removeprefix("# stats "))
    assert st["verified"]["instructions"] == st["instructions"] > st0["instructions"]
    assert "GDN steps in 3 parts" in r.output and "as assembled" in base.output
    bad = run(["inspect", "--preset", "tiny", "--gdn-split", "4"])
    assert bad.exit_code == 2 and "--gdn-split" in bad.output and "Traceback" not in bad.output


# ---------------------------------------------------------------------------------------------- make-checkpoint
@pytest.fixture
def fake_writer(monkeypatch):
    """Replace the (slow) synthetic writer: writes config.json and a shard into its directory, then does what
    ``fake_writer.fail`` says (None, an exception to raise)."""
    import host.commands.make_checkpoint as mc

    class Fake:
        fail: BaseException | None = None
        dirs: list = []

        def __call__(self, cfg, out, seed, **kw):
            out.mkdir(parents=True)
            self.dirs.append(out)
            (out / "config.json").write_text('{"new": true}')
            (out / "model.safetensors").write_bytes(b"x" * 16)
            if self.fail is not None:
                raise self.fail
            return {"seconds": 0.1, "bytes": 16, "shards": 1, "tokenizer": False}

    f = Fake()
    f.dirs = []
    monkeypatch.setattr(mc, "write_checkpoint", f)
    return f


def _siblings(d):
    return sorted(p.name for p in d.parent.iterdir() if p.name.startswith(f".{d.name}."))


def test_make_checkpoint_refuses_a_non_empty_out(tmp_path, fake_writer):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = run(["make-checkpoint", "--preset", "tiny", "--out", str(out), "--no-tokenizer"])
    assert r.exit_code == 2, r.output
    assert f"directory {out} is not empty" in r.output and "--force" in r.output and "Traceback" not in r.output
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and not fake_writer.dirs and not _siblings(out)


def test_make_checkpoint_force_replaces_and_empty_out_is_fine(tmp_path, fake_writer):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "config.json").write_text("{}")  # a previous checkpoint: --force replaces all of it
    (out / "old.txt").write_text("old")
    r = run(["make-checkpoint", "--preset", "tiny", "--out", str(out), "--force", "--no-tokenizer"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"] and not _siblings(out)
    assert fake_writer.dirs[0] != out and fake_writer.dirs[0].parent == out.parent  # a temporary sibling
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run(["make-checkpoint", "--preset", "tiny", "--out", str(empty), "--no-tokenizer"])
    assert r.exit_code == 0, r.output
    assert (empty / "config.json").is_file() and not _siblings(empty)


def test_make_checkpoint_force_refuses_a_directory_that_is_not_a_checkpoint(tmp_path, fake_writer):
    """--force replaces only a previous checkpoint (config.json or *.safetensors inside): `--out ~ --force` must not
    delete a home directory (nor an unrelated notes.txt in it)."""
    out = tmp_path / "home"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    r = run(["make-checkpoint", "--preset", "tiny", "--out", str(out), "--force", "--no-tokenizer"])
    assert r.exit_code == 2, r.output
    assert "does not look like a checkpoint" in r.output and "Traceback" not in r.output
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and not fake_writer.dirs and not _siblings(out)


@pytest.mark.parametrize("fail", [OSError(28, "No space left on device"), KeyboardInterrupt()],
                         ids=["disk-full", "ctrl-c"])
@pytest.mark.parametrize("existing", [False, True], ids=["new", "force"])
def test_make_checkpoint_never_leaves_a_half_written_checkpoint(tmp_path, fake_writer, fail, existing):
    out = tmp_path / "ckpt"
    if existing:
        out.mkdir()
        (out / "config.json").write_text('{"old": true}')
    fake_writer.fail = fail
    r = run(["make-checkpoint", "--preset", "tiny", "--out", str(out), "--no-tokenizer",
             *(["--force"] if existing else [])])
    assert r.exit_code != 0 and "Traceback" not in r.output
    if isinstance(fail, OSError):
        assert f"cannot write the checkpoint to --out {out}: No space left on device" in r.output
    else:  # README: 130 interrupted, one line (not click's "Aborted!", exit 1)
        assert r.exit_code == 130 and "Aborted" not in r.output, r.output
        assert r.output.strip() == f"qwen-mk: error: interrupted: nothing was written to --out {out}"
    if existing:  # the old checkpoint is untouched
        assert sorted(p.name for p in out.iterdir()) == ["config.json"]
        assert json.loads((out / "config.json").read_text()) == {"old": True}
    else:
        assert not out.exists()
    assert not _siblings(out) and not fake_writer.dirs[0].exists()


def test_make_checkpoint_real_write_opens(tmp_path):
    """The real writer through the temporary directory: a complete, valid checkpoint lands in --out."""
    from loader.checkpoint import Checkpoint
    out = tmp_path / "ckpt"
    r = run(["make-checkpoint", "--preset", "tiny", "--out", str(out), "--no-tokenizer", "--workers", "2"])
    assert r.exit_code == 0, r.output
    assert f"to {out}:" in r.output and not _siblings(out)
    assert Checkpoint.open(out).config == preset("tiny").replace(name="ckpt")


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_make_checkpoint_error_names_the_path_once(tmp_path, monkeypatch, relative):
    """An --out below a file: one line naming --out once (not '--out B/ckpt: Not a directory (B/ckpt)')
    and the ancestor that is not a directory."""
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.chdir(tmp_path)
    blocker = "file" if relative else str(tmp_path / "file")
    out = f"{blocker}/ckpt"
    r = run(["make-checkpoint", "--preset", "tiny", "--out", out, "--no-tokenizer"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output  # a bad --out (README: exit 2; was 1)
    want = f"cannot write the checkpoint to --out {out}: {blocker} is not a directory"
    assert r.output.strip() == f"qwen-mk: error: {want}"
    assert r.output.count(out) == 1


# ---------------------------------------------------------------------------------------------- config.json errors
@pytest.mark.parametrize("text,needles", [
    ("{}", ["missing required field(s) " + ", ".join(REQUIRED_FIELDS), "text-only layout", "text_config"]),
    ('{"text_config": {}}', ["missing required field(s) vocab_size", "in 'text_config'"]),
    ('{"text_config": {"num_hidden_layers": 3}}', ["missing required field(s) vocab_size, hidden_size, "
                                                   "intermediate_size, num_attention_heads"]),
    ("[1, 2]", ["got a JSON list", "expected a Qwen3.5 config.json: a JSON object"]),
    ('"qwen"', ["got a JSON string"]),
    ("{not json", ["not valid JSON"]),
    ("", ["not valid JSON"]),
    ('{"text_config": [1]}', ["'text_config' must be a JSON object, got a JSON list"]),
], ids=["empty-object", "empty-text-config", "partial", "list", "string", "invalid", "empty-file", "text-list"])
def test_bad_config_json_names_the_file_and_the_problem(tmp_path, text, needles):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(text)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_file(d)
    msg = str(e.value)
    assert msg.startswith(f"{d / 'config.json'}: ") and all(n in msg for n in needles), msg
    r = run(["generate", "hi", "--model", str(d), "--executor", "cpu"])
    assert r.exit_code == ModelLoadError.exit_code and "Traceback" not in r.output, r.output
    assert f"{d / 'config.json'}: " in r.stderr and all(n in r.stderr for n in needles), r.stderr


def _tiny_config() -> dict:
    return {"text_config": preset("tiny").to_text_config(),
            "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "weight_block_size": [128, 128]}}


@pytest.mark.parametrize("where,value,needle", [
    ("quantization_config", 3, "'quantization_config' must be a JSON object, got a JSON number"),
    ("text_config.rope_parameters", [], "'rope_parameters' must be a JSON object, got a JSON list"),
    ("text_config.layer_types", 3, "'layer_types' must be a JSON list"),
    ("text_config.full_attention_interval", 0, "'full_attention_interval': expected a positive integer, got 0"),
    ("text_config.rms_norm_eps", "x", "'rms_norm_eps': expected a number, got 'x'"),
    ("text_config.partial_rotary_factor", "x", "'rope_parameters.partial_rotary_factor': expected a number"),
    ("text_config.eos_token_id", "x", "'eos_token_id': expected a token id"),
    ("quantization_config.weight_block_size", 128, "'quantization_config.weight_block_size': expected [128, 128]"),
])
def test_malformed_config_values_are_config_errors(where, value, needle):
    """Values of the wrong JSON type: a ConfigError naming the field (no AttributeError / TypeError /
    ZeroDivisionError out of the parser)."""
    d = _tiny_config()
    *path, key = where.split(".")
    o = d
    for k in path:
        o = o[k]
    o[key] = value
    if key == "full_attention_interval":
        del d["text_config"]["layer_types"]
    if key == "partial_rotary_factor":
        del d["text_config"]["rope_parameters"]
    with pytest.raises(ConfigError, match="^cfg/config.json: ") as e:
        ModelConfig.from_dict(d, source="cfg/config.json")
    assert needle in str(e.value)


def test_tiny_config_parses():
    assert ModelConfig.from_dict(_tiny_config()) == preset("tiny").replace(name="custom")


def test_absent_config_json_names_the_file_once(tmp_path):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_file(tmp_path)
    assert str(e.value) == f"{tmp_path / 'config.json'}: file not found"


def test_model_dir_error_names_the_path_once(tmp_path):
    """A model directory without weights: the loader's message already starts with the path; the engine's
    ModelLoadError must not prefix it a second time."""
    from host.engine import Engine
    from host.errors import ModelLoadError
    d = tmp_path / "m1"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError) as ei:
        Engine.load(str(d), executor="cpu")
    assert str(ei.value).count(str(d)) == 1, str(ei.value)
