"""The `mira` command: every subcommand answers --help, generate runs the bundled model in seconds, and a user
mistake is one line on stderr with exit status 2, never a traceback."""

import contextlib
import io
import json
import subprocess
import sys
import types

import pytest
import torch

from mira_hf import MiraError, cli
from mira_hf.bundled import bundled_model_path, resolve_model_name

COMMANDS = ("generate", "calibrate", "bench", "stats", "env")


def run(argv, capsys):
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, out, err, *fragments):
    assert rc == 2
    assert "Traceback" not in err and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mira: error: "), err
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command, capsys):
    rc, out, _ = run([command, "--help"], capsys)
    assert rc == 0 and out.startswith(f"usage: mira {command}")


def test_no_command_prints_help_and_fails(capsys):
    rc, out, _ = run([], capsys)
    assert rc == 2 and all(c in out for c in COMMANDS)


def test_bundled_model_resolves():
    path = bundled_model_path()
    assert resolve_model_name(None) == resolve_model_name("mira-tiny") == path
    assert resolve_model_name("/some/where") == "/some/where"


def test_missing_bundled_model_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("mira_hf.bundled.BUNDLED_NAME", "not-shipped")
    with pytest.raises(MiraError, match="missing"):
        bundled_model_path()


@pytest.mark.parametrize(
    "text, value",
    [
        ("0.25", 0.25),
        ("1.0", 1.0),
        ("1e-1", 0.1),
        ("2.5E-2", 0.025),
        ("12GiB", "12GiB"),
        ("500 MB", "500 MB"),
        ("1048576", 1048576),
        (None, None),
    ],
)
def test_budget_text_becomes_a_mira_config_value(text, value):
    assert cli.parse_budget(text) == value


# -- generate ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """One in-process `mira generate` on the bundled model: (exit status, stdout, stats file)."""
    stats_file = tmp_path_factory.mktemp("gen") / "run.json"
    argv = ["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "8", "--device", "cpu", "--stats-out", str(stats_file)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = cli.main(argv)
    return rc, out.getvalue(), stats_file


def test_generate_streams_text_then_prints_stats(generated):
    rc, out, _ = generated
    assert rc == 0
    assert out.startswith("def add(a, b):")  # the streamer prints the prompt, then the new text
    for label in ("hit rate", "bytes moved", "stall", "tokens/s", "peak GPU memory  n/a (cpu)"):
        assert label in out
    assert "layer  hit rate" in out  # the per-layer table


def test_generate_writes_a_stats_file(generated):
    _, _, stats_file = generated
    record = json.loads(stats_file.read_text())
    assert record["format"] == "mira-stats" and record["generation"]["new_tokens"] <= 8
    stats = record["stats"]
    assert stats["hits"] + stats["misses"] > 0 and 0.0 <= stats["hit_rate"] <= 1.0
    assert record["config"]["gpu_budget"] == 0.25 and record["config"]["dtype"] == "float32"  # CPU defaults


def test_generate_splits_experts_between_host_and_device_when_asked(tmp_path):
    stats_file = tmp_path / "run.json"
    argv = ["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "4", "--device", "cpu"]
    argv += ["--host-compute", "split", "--host-share", "0.3", "--stats-out", str(stats_file)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert cli.main(argv) == 0
    record = json.loads(stats_file.read_text())
    assert record["stats"]["host_part_bytes"] > 0
    # an inexact mode is named in the settings printed and saved
    assert record["config"]["host_compute"] == "split" and record["config"]["host_share"] == 0.3
    assert "host_compute=split, host_share=0.3" in out.getvalue()


def test_generate_counts_an_encoder_decoders_new_tokens(tmp_path):
    """An encoder-decoder's output holds its decoder's tokens only (a start token, then the new ones), not the prompt."""
    import torch
    from transformers import AutoTokenizer

    from mira_hf.testing import build, make_config

    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    config = make_config("switch_transformers", vocab_size=len(tokenizer), eos_token_id=len(tokenizer) + 1)  # no eos
    torch.manual_seed(0)
    build(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    stats_file = tmp_path / "run.json"
    argv = ["generate", str(tmp_path / "model"), "--prompt", "def add(a, b):", "--max-new-tokens", "5", "--device", "cpu"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert cli.main([*argv, "--stats-out", str(stats_file)]) == 0
    record = json.loads(stats_file.read_text())
    assert record["generation"]["new_tokens"] == 5
    assert record["stats"]["hits"] + record["stats"]["misses"] > 0


def test_stats_summarises_a_saved_stats_file(generated, capsys):
    rc, out, _ = run(["stats", str(generated[2])], capsys)
    assert rc == 0 and "hit rate" in out and "tokens/s" in out and "layer  hit rate" in out


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["generate", "--prompt", "x", "--budget", "lots"], ["gpu_budget='lots'"]),
        (["generate", "--prompt", "x", "--budget", "1.5"], ["gpu_budget=1.5"]),
        (["generate", "/nonexistent/model", "--prompt", "x"], ["/nonexistent/model"]),
        (["generate", "--prompt", "x", "--policy", "fifo"], ["policy='fifo'", "Supported: lru, heat, priority"]),
        (["generate", "--prompt", "x", "--temperature", "0.7"], ["--do-sample"]),
        (["generate", "--prompt", "x", "--host-compute", "sometimes"], ["host_compute='sometimes'", "split"]),
        (["generate", "--prompt", "x", "--host-compute", "split", "--host-share", "2"], ["host_share=2.0"]),
        (["stats", "/nonexistent/run.json"], ["no such file"]),
        (["calibrate", "mira-tiny", "--data", "/nonexistent.txt", "--out", "/tmp/x"], ["--data"]),
        (["env", "--model", "/nonexistent/model"], ["/nonexistent/model"]),
        (["bench", "no-such-benchmark"], ["no-such-benchmark"]),
        (["generate", "--prompt", "x", "--predictor", "Learned"], ["--predictor learned needs --predictor-path DIR"]),
        (["serve", "--concurrency", "8"], ["--concurrency shapes", "--device-memory"]),  # it would change nothing
        (["serve", "--routing-trace", "trace"], ["--routing-trace shapes", "--device-memory"]),
        (["serve", "--max-tokens", "0"], ["--max-tokens 0: must be ≥ 1"]),
        (["serve", "--device-memory", "1GiB", "--prompt-tokens", "-1"], ["--prompt-tokens -1: must be ≥ 1"]),
    ],
)
def test_user_mistakes_are_one_line_and_exit_2(argv, fragments, capsys):
    assert_one_line_error(*run(argv, capsys), *fragments)


@pytest.mark.parametrize(
    "argv, fragments",
    [  # output paths that cannot be written, refused as the arguments are read: before the model loads, not after
        (["generate", "--prompt", "x", "--stats-out", "/tmp"], ["--stats-out", "is a directory"]),
        (["generate", "--prompt", "x", "--stats-out", __file__ + "/run.json"], ["--stats-out", "is a file"]),
        (["calibrate", "mira-tiny", "--data", __file__, "--out", __file__], ["--out", "not a directory"]),
        (["serve", "--port", "70000"], ["--port", "0-65535"]),
    ],
)
def test_unusable_outputs_and_ports_are_argument_errors(argv, fragments, capsys):
    rc, out, err = run(argv, capsys)
    assert rc == 2 and out == "" and "Traceback" not in err
    assert all(fragment in err for fragment in fragments), err


def test_argparse_mistakes_exit_2(capsys):
    rc, _, err = run(["generate"], capsys)  # --prompt is required
    assert rc == 2 and "--prompt" in err and "Traceback" not in err


def test_stats_rejects_an_unknown_format(tmp_path, capsys):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"hello": 1}))
    assert_one_line_error(*run(["stats", str(path)], capsys), "expected")
    path.write_text(json.dumps({"format": "mira-stats"}))  # cut short: no "stats" object
    assert_one_line_error(*run(["stats", str(path)], capsys), 'no "stats" object')


@pytest.mark.parametrize("stats", [{"hits": "x"}, {"per_layer": [1, 2]}])
def test_stats_refuses_a_file_whose_fields_hold_something_else(tmp_path, capsys, stats):
    path = tmp_path / "edited.json"
    path.write_text(json.dumps({"stats": stats}))
    assert_one_line_error(*run(["stats", str(path)], capsys), "reads as a stats file, but a field holds something else")


def test_stats_piped_into_a_reader_that_stops_early_ends_quietly(tmp_path):
    """`mira stats FILE | head`: the reader closes the pipe; mira stops without a traceback, as Unix tools do."""
    layers = {str(i): {"hits": 1, "misses": 1, "hit_rate": 0.5} for i in range(3000)}  # far more than a pipe buffers
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"stats": {"hits": 3000, "misses": 3000, "hit_rate": 0.5, "per_layer": layers}}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "mira_hf.cli", "stats", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


# -- calibrate --------------------------------------------------------------------------------------
@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("def add(a, b):\n    return a + b\n\n" * 20)
    return path


def test_calibrate_writes_router_top_k_per_token(corpus, tmp_path, capsys):
    from safetensors.torch import load_file

    out_dir = tmp_path / "traces"
    argv = ["calibrate", "mira-tiny", "--data", str(corpus), "--out", str(out_dir), "--max-tokens", "96", "--chunk-tokens", "32"]
    rc, out, _ = run([*argv, "--device", "cpu", "--traces-only"], capsys)
    assert rc == 0 and "router_topk.safetensors" in out
    trace = json.loads((out_dir / "router_topk.json").read_text())
    tensors = load_file(out_dir / "router_topk.safetensors")
    n, k = trace["tokens"], trace["top_k"]
    assert n == 96 and tensors["input_ids"].shape == (n,) and tensors["chunk_lengths"].tolist() == [32, 32, 32]
    for layer, entry in trace["layers"].items():
        assert tensors[f"topk.{layer}"].shape == (n, k)
        assert sum(entry["counts"]) == n * k
    assert tensors["counts"].shape == (trace["num_layers"], trace["num_experts"])
    rc, out, _ = run(["stats", str(out_dir / "router_topk.json")], capsys)
    assert rc == 0 and "top-25% share" in out


def test_calibrate_hands_the_tokens_to_mira_hf_calibrate_when_present(corpus, tmp_path, capsys, monkeypatch):
    calls = []
    fake = types.ModuleType("mira_hf.calibrate")
    fake.calibrate = lambda model, data, out_dir, max_tokens: calls.append((model, data, out_dir, max_tokens))
    monkeypatch.setitem(sys.modules, "mira_hf.calibrate", fake)
    out_dir = tmp_path / "cal"
    argv = ["calibrate", "mira-tiny", "--data", str(corpus), "--out", str(out_dir), "--max-tokens", "40", "--device", "cpu"]
    rc, out, _ = run(argv, capsys)
    assert rc == 0 and len(calls) == 1 and f"--predictor-path {out_dir}" in out
    model, chunks, written_to, max_tokens = calls[0]
    assert hasattr(model, "mira") and sum(len(chunk) for chunk in chunks) == max_tokens == 40 and written_to == str(out_dir)


@pytest.mark.parametrize(
    "ids, said", [([5, 99999, 7], "run from 5 to 99999, outside the model's vocabulary"), ([-1, 4], "run from -1")]
)
def test_calibrate_refuses_token_ids_outside_the_vocabulary(tmp_path, capsys, ids, said):
    from safetensors.torch import save_file

    data = tmp_path / "ids.safetensors"
    save_file({"input_ids": torch.tensor([ids])}, str(data))
    argv = ["calibrate", "mira-tiny", "--data", str(data), "--out", str(tmp_path / "cal"), "--device", "cpu"]
    _error_after_loading(*run(argv, capsys), said)
    assert not (tmp_path / "cal").exists()


@pytest.mark.parametrize(
    "content, said",
    [(b"garbage", "is not a readable .safetensors file"), (None, "has no 'input_ids' tensor"), ("dir", "a directory")],
    ids=["not-safetensors", "no-input-ids", "a-directory"],
)
def test_calibrate_refuses_a_corpus_it_cannot_read_before_loading_the_model(tmp_path, capsys, content, said):
    from safetensors.torch import save_file

    data = tmp_path / "ids.safetensors"
    if content == "dir":
        data.mkdir()
    elif content is None:
        save_file({"tokens": torch.tensor([[5, 7, 9]])}, str(data))
    else:
        data.write_bytes(content)
    argv = ["calibrate", "mira-tiny", "--data", str(data), "--out", str(tmp_path / "cal"), "--device", "cpu"]
    rc, out, err = run(argv, capsys)
    assert rc == 2 and err.strip().splitlines() == [err.strip().splitlines()[-1]], err  # one line: no model was loaded
    assert err.startswith("mira: error: ") and said in err and not (tmp_path / "cal").exists()


def _error_after_loading(rc, out, err, fragment):
    """Exit 2 with mira's one-line error last, after the model's loading messages, and no traceback."""
    assert rc == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("mira: error: ") and fragment in last, err


def test_calibrate_says_how_few_tokens_the_corpus_holds(tmp_path, capsys):
    data = tmp_path / "one.txt"
    data.write_text("x")
    argv = ["calibrate", "mira-tiny", "--data", str(data), "--out", str(tmp_path / "cal"), "--device", "cpu"]
    _error_after_loading(*run(argv, capsys), "holds 1 token; training the predictor needs at least 2")


# -- bench, env -------------------------------------------------------------------------------------
def test_bench_lists_scripts(capsys):
    rc, out, _ = run(["bench"], capsys)
    assert rc == 0 and "benchmark scripts" in out
    listed = {line.split()[0] for line in out.split("\n", 1)[1].splitlines() if line.strip()}
    assert "run" in listed and "full_depth" in listed
    assert not listed & {"common", "timing", "routing_stats", "topic_routing"}  # modules the scripts import


def test_bench_runs_a_script_with_its_arguments(tmp_path, monkeypatch, capsys):
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "echo.py").write_text('"""Echo."""\nimport sys\nprint("args", sys.argv[1:])\nsys.exit(3)\n')
    monkeypatch.setattr(cli.bench, "_benchmarks_dir", lambda: bench)
    rc, out, _ = run(["bench", "echo", "--", "--models", "bundled"], capsys)
    assert rc == 3 and "args ['--models', 'bundled']" in out


def test_env_reports_versions_and_suggests_a_budget(capsys):
    rc, out, _ = run(["env", "--model", "mira-tiny"], capsys)
    assert rc == 0
    for text in ("torch", "transformers", "safetensors", "memory", "routed experts", "gpu_budget"):
        assert text in out


def test_env_says_which_config_json_is_not_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{")
    assert_one_line_error(*run(["env", "--model", str(tmp_path)], capsys), f"{tmp_path}/config.json is not valid JSON")


def test_generate_names_the_checkpoint_whose_tokenizer_cannot_be_built(tmp_path, capsys):
    """A checkpoint saved without its tokenizer (as `save_pretrained` of a model alone leaves it)."""
    from mira_hf.testing import build, tiny_config

    build(tiny_config("mixtral")).save_pretrained(tmp_path)
    capsys.readouterr()  # the save's progress bar
    rc, out, err = run(["generate", str(tmp_path), "--prompt", "hi", "--device", "cpu"], capsys)
    assert_one_line_error(rc, out, err, f"could not load a tokenizer from {tmp_path} (its tokenizer.json")


def test_env_counts_the_checkpoint_bytes_from_its_headers():
    from safetensors.torch import load_file

    from mira_hf.cli import env

    path = bundled_model_path()
    expert, other, layers, files = env._checkpoint_bytes(path)
    tensors = load_file(f"{path}/{files[0]}")
    assert files == ["model.safetensors"] and len(layers) == 6
    assert expert == sum(t.nbytes for k, t in tensors.items() if ".experts." in k)
    assert expert + other == sum(t.nbytes for t in tensors.values())


def test_env_suggests_the_budget_that_gpu_budget_none_gives(monkeypatch):
    """On a GPU, `mira env --model` suggests what the library itself would take: min(all experts, 0.9 x free
    memory - non-expert weights), and says so when the non-expert weights do not fit."""
    import torch

    from mira_hf import report
    from mira_hf.budget import default_budget_bytes
    from mira_hf.cli import env

    expert, other, _, _ = env._checkpoint_bytes(bundled_model_path())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for free, share in ((10 * (expert + other), "every expert fits"), (2 * other + expert // 2, "% of the experts")):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_, free=free: (free, 2 * free))
        text = dict(env._budget_suggestion("mira-tiny"))["gpu_budget"]
        want = default_budget_bytes(free, expert, other)
        assert text.startswith(f'"{report.format_bytes(want).replace(" ", "")}" (') and share in text
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (other, 2 * other))
    assert "do not fit in 90%" in dict(env._budget_suggestion("mira-tiny"))["gpu_budget"]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--host-share", "0.3"], "--host-share 0.3 applies to --host-compute split only"),
        (["--host-compute", "auto", "--host-share", "0.3"], "--host-share 0.3 applies to --host-compute split only"),
        (["--do-sample", "--temperature", "0"], "--temperature 0.0: must be > 0"),
    ],
)
def test_generate_refuses_options_that_would_change_nothing_or_fail_late(argv, says):
    """Refused before the model loads, with a one-line error (exit status 2)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert cli.main(["generate", "--prompt", "hi", *argv]) == 2
    assert says in err.getvalue()
