"""The command contract: `doel-train tokenizer | fertility | prepare | demo`, as users run them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here runs the command in a fresh process
ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "train" / "sample"
PUNCTUATION_RUN = re.compile(r"[!-/:-@\[-`{-~\u0964\u0965\u2018-\u201f]{3,}")  # ASCII, ।, ॥, quotes


def small_model(folder: Path, tokenizer_path) -> Path:
    """A random one-layer model on the session tokenizer, saved in Hugging Face layout."""
    import torch

    from doel.train.hf import save_model
    from doel.train.model import Llama, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=2048,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    return save_model(Llama(cfg), folder, tokenizer=tokenizer_path)


def run(*args, check=True, pre=""):
    cli = "doel.pipeline.cli" if args[0] in ("demo", "recipe") else "doel.train.cli"
    code = f"{pre}from {cli} import main; main({list(args)!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if check and proc.returncode:
        raise AssertionError(proc.stderr)
    return proc


def test_tokenizer_fertility_prepare_contract(tmp_path, sample_paths):
    run(
        "tokenizer",
        "--data",
        *sample_paths,
        "--vocab-size",
        "1024",
        "--out",
        str(tmp_path / "tok"),
        "--quiet",
    )
    tok = tmp_path / "tok" / "tokenizer.json"
    assert tok.is_file()
    out = run("fertility", "--tokenizer", str(tok), "--text", *sample_paths, "--json").stdout
    report = json.loads(out)
    assert set(report) >= {"bengali", "latin"}
    for r in report.values():
        assert {
            "chars_per_token",
            "bytes_per_token",
            "words_per_token",
            "tokens_per_word",  # the unit Bangla tokenizer papers report
            "byte_fallback_rate",
        } <= set(r)
        assert r["tokens_per_word"] == pytest.approx(1 / r["words_per_token"])
    run(
        "prepare",
        "--tokenizer",
        str(tok),
        "--data",
        *sample_paths,
        "--out",
        str(tmp_path / "shards"),
        "--weights",
        "bn=0.6",
        "en=0.4",
        "--val-fraction",
        "0.1",
        "--quiet",
    )
    meta = json.loads((tmp_path / "shards" / "meta.json").read_text())
    assert meta["sources"]["bn"]["requested_char_share"] == pytest.approx(0.6)
    assert meta["splits"]["val"]["documents"] > 0


def test_python_dash_m_train_works():
    proc = subprocess.run(
        [sys.executable, "-m", "doel.train", "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0 and "fertility" in proc.stdout


def test_user_errors_are_one_line_without_traceback(tmp_path):
    proc = run(
        "prepare",
        "--tokenizer",
        str(tmp_path / "x.json"),
        "--data",
        "a.txt",
        "--out",
        str(tmp_path),
        check=False,
    )
    assert proc.returncode != 0
    assert proc.stderr.startswith("error: tokenizer not found") and "Traceback" not in proc.stderr
    proc = run(
        "tokenizer", "--data", "a.txt", "--out", str(tmp_path), "--vocab-size", "10", check=False
    )
    assert "vocab_size=10" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_extra_names_the_pip_install(tmp_path, sample_paths):
    # Pretend the train extra is not installed: importing `tokenizers` fails.
    proc = run(
        "tokenizer",
        "--data",
        *sample_paths,
        "--out",
        str(tmp_path),
        check=False,
        pre="import sys; sys.modules['tokenizers'] = None; ",
    )
    assert proc.returncode != 0
    assert "pip install 'doel[train]'" in proc.stderr and "'tokenizers'" in proc.stderr


def test_demo_runs_the_main_job(tmp_path):
    proc = run("demo", "--out", str(tmp_path))  # the default, as `make demo` runs it
    # Both runs finish: pre-training, then the chat fine-tuning.
    finished = re.findall(r"^finished: \d+ steps", proc.stdout, re.M)
    assert len(finished) == 2, "training stopped early"
    assert "fertility of" in proc.stdout and "language balance" in proc.stdout
    assert (tmp_path / "tokenizer" / "tokenizer.json").is_file()
    assert (tmp_path / "shards" / "meta.json").is_file()
    assert "pass gradient_flow" in proc.stdout  # the gate ran, inside the verification suite
    assert "| bn |" in proc.stdout and "| en |" in proc.stdout  # the evaluation table
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "curves.png").is_file()
    # Then a few steps of chat fine-tuning, checked before step 1, and the chat model's own
    # bundle: it carries the chat template.
    assert "pass loss_mask" in proc.stdout
    for folder in ("chat/final", "bundle-chat-int4"):
        config = json.loads((tmp_path / folder / "tokenizer_config.json").read_text("utf-8"))
        assert config["chat_template"].startswith("{{ bos_token }}"), folder
    # It ends served: a Bangla completion fetched over HTTP, then the playground's URL. The
    # request is seeded, so the bundle served again here gives the text it printed.
    from fastapi.testclient import TestClient

    from doel.pipeline.demo import DEMO_CHAT, DEMO_REQUEST
    from doel.serve.edge.app import Settings, create_app

    with TestClient(create_app(Settings(bundle=str(tmp_path / "bundle-int4")))) as c:
        end = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < end, c.get("/health").json()
            time.sleep(0.02)
        want = c.post("/v1/completions", json=DEMO_REQUEST).json()
    with TestClient(create_app(Settings(bundle=str(tmp_path / "bundle-chat-int4")))) as c:
        end = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < end, c.get("/health").json()
            time.sleep(0.02)
        chat = c.post("/v1/chat/completions", json=DEMO_CHAT).json()
    assert want["usage"]["completion_tokens"] > 0

    # Readable Bangla, not punctuation runs: the served words are the sample's words.
    def bangla_words(text: str) -> list[str]:  # NFC, as the tokenizer normalizes (ড় ঢ় য়)
        return re.findall(r"[\u0980-\u09ff]+", unicodedata.normalize("NFC", text))

    words = bangla_words(want["choices"][0]["text"])
    sample = set(bangla_words((SAMPLE / "bn.txt").read_text("utf-8")))
    assert len(words) >= 8 and sum(w in sample for w in words[:-1]) >= 0.8 * (len(words) - 1)
    assert not PUNCTUATION_RUN.search(want["choices"][0]["text"])
    assert f"{DEMO_REQUEST['prompt']}{want['choices'][0]['text']}\n" in proc.stdout
    # One chat exchange over HTTP (greedy, so the same reply again here), in Bangla words.
    reply = chat["choices"][0]["message"]["content"]
    assert f"    assistant: {reply}\n" in proc.stdout and bangla_words(reply)
    url = re.search(r"^serve: .* at (http://127\.0\.0\.1:\d+) ", proc.stdout, re.M)
    # The address dies with the demo: without --serve it names the command that serves it.
    assert url and "\nplayground: `doel-serve " in proc.stdout
    assert f"{url.group(1)}/ " not in proc.stdout
    # The default tokenizer style runs in llama.cpp: the demo ends with a GGUF and its command.
    gguf = tmp_path / "gguf" / "model-f16.gguf"
    assert gguf.is_file() and f"llama.cpp: llama-cli -m {gguf} " in proc.stdout
    _greedy_in_llama_cpp_is_doel_serves(tmp_path, gguf)


def _greedy_in_llama_cpp_is_doel_serves(tmp_path, gguf):
    """llama.cpp's greedy continuation of a Bangla prompt on the demo's GGUF is doel-serve's on
    an fp32 bundle of the same model (where llama-cpp-python is installed; CI does not build
    it)."""
    try:
        import llama_cpp
    except ImportError:
        return
    from fastapi.testclient import TestClient

    from doel.export.bundle import ExportOptions, export_checkpoint
    from doel.pipeline.demo import DEMO_REQUEST
    from doel.serve.edge.app import Settings, create_app
    from doel.train.data.tokenizer import load_tokenizer

    final, bundle = tmp_path / "run" / "final", tmp_path / "bundle-fp32"
    export_checkpoint(final, bundle, ExportOptions(quant="fp32", force=True, log=lambda *_: None))
    prompt = load_tokenizer(final).encode(DEMO_REQUEST["prompt"]).ids
    llm = llama_cpp.Llama(str(gguf), n_ctx=256, verbose=False)
    theirs = []
    for i in llm.generate(prompt, temp=0.0, top_k=1):
        if i == llm.token_eos():  # doel-serve stops there too
            break
        theirs.append(i)
        if len(theirs) == 16:
            break
    with TestClient(create_app(Settings(bundle=str(bundle)))) as c:
        end = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < end, c.get("/health").json()
            time.sleep(0.02)
        req = {"prompt": prompt, "max_tokens": 16, "temperature": 0}
        ours = c.post("/v1/completions", json=req).json()["choices"][0]["text"]
    assert llm.detokenize(theirs, prev_tokens=prompt).decode() == ours


def test_fit_check_gradients_eval_plot_commands(tmp_path, tokenizer_path, sample_paths):
    shards = tmp_path / "shards"
    run(
        "prepare",
        "--tokenizer",
        str(tokenizer_path),
        "--data",
        *sample_paths,
        "--out",
        str(shards),
        "--quiet",
    )
    gate = run("check-gradients", "--config", "tiny", "--data", str(shards))
    assert "every one has a finite, nonzero gradient" in gate.stdout
    bad = run(
        "check-gradients",
        "--config",
        "tiny",
        "--data",
        str(shards),
        "--set",
        "model.vocab_size=64",
        check=False,
    )
    assert bad.returncode != 0 and "model.vocab_size" in bad.stderr
    run(
        "fit",
        "--config",
        "tiny",
        "--data",
        str(shards),
        "--out",
        str(tmp_path / "run"),
        "--steps",
        "4",
    )
    # The same run resumed without --config: the config it recorded, not some preset's.
    again = run("fit", "--data", str(shards), "--out", str(tmp_path / "run"), "--steps", "6")
    assert "config: the one" in again.stdout and "resuming from" in again.stdout
    final = json.loads((tmp_path / "run" / "final" / "train_config.json").read_text())
    assert (final["steps"], final["model"]["hidden_size"]) == (6, 64)  # tiny's, at 6 steps
    ev = run("eval", str(tmp_path / "run" / "final"), "--text", *sample_paths, "--json")
    result = json.loads(ev.stdout)
    assert set(result["languages"]) == {"bn", "en"}
    run("plot", str(tmp_path / "run"))
    assert (tmp_path / "run" / "curves.png").is_file()
    missing = run(
        "fit",
        "--config",
        "no-such-preset",
        "--data",
        str(shards),
        "--out",
        str(tmp_path / "x"),
        check=False,
    )
    assert missing.returncode != 0 and "presets" in missing.stderr


def one_line_error(proc, *names) -> str:
    """The command failed with one line on stderr, no traceback, naming each of `names`."""
    err = proc.stderr.strip()
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert all(str(n) in err for n in names), err
    return err


def test_damaged_files_are_one_line_errors_naming_them(tmp_path, tokenizer_path, sample_paths):
    cut = tmp_path / "tokenizer.json"
    cut.write_bytes(tokenizer_path.read_bytes()[:5000])
    one_line_error(
        run("fertility", "--tokenizer", str(cut), "--text", *sample_paths, check=False), cut
    )
    folder = small_model(tmp_path / "model", tokenizer_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # a copy cut short
    err = one_line_error(run("eval", str(folder), "--text", *sample_paths, check=False), weights)
    assert "truncated or damaged" in err


def test_a_bad_config_value_fails_before_torch_is_imported(tmp_path, shards):
    report = "import atexit, sys; atexit.register(lambda: print('torch' in sys.modules)); "
    for command in ("fit", "check-gradients", "verify"):
        args = [command, "--config", "tiny", "--data", str(shards), "--set", "lr=abc"]
        args += ["--out", str(tmp_path / command)] if command != "check-gradients" else []
        proc = run(*args, check=False, pre=report)
        one_line_error(proc, "--set lr", "'abc'")
        assert proc.stdout.strip() == "False"  # validated without importing torch


def test_ctrl_c_during_fit_is_one_line_and_a_damaged_checkpoint_is_named(tmp_path, shards):
    import signal

    run_dir = tmp_path / "run"
    args = ["fit", "--config", "tiny", "--data", str(shards), "--out", str(run_dir)]
    args += ["--set", "steps=100000", "--set", "checkpoint_every=2", "--skip-verify"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "doel.train", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as a terminal delivers it: a suite started in the background by a shell
        # without job control inherits SIGINT ignored, and Python then never raises
        # KeyboardInterrupt in the child.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        end = time.monotonic() + 180
        while not list(run_dir.glob("checkpoints/step-*")):
            assert proc.poll() is None and time.monotonic() < end, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.communicate()  # reaped and its pipes closed, whatever happened above
    assert proc.returncode == 130 and "Traceback" not in err, err
    last = sorted(run_dir.glob("checkpoints/step-*"))[-1]
    line = err.strip()
    assert re.fullmatch(
        rf"interrupted at step (\d+); the last checkpoint is {re.escape(str(last))}; run the "
        "same command to resume from it",
        line,
    ), line
    assert int(re.match(r"interrupted at step (\d+)", line).group(1)) >= int(last.name[5:])
    # The same command on a checkpoint damaged since: one line naming the file and the way on.
    optimizer = last / "optimizer.safetensors"
    optimizer.write_bytes(optimizer.read_bytes()[:-100])
    err = one_line_error(run(*args, check=False), optimizer, f"delete {last}")
    assert "truncated or damaged" in err


def test_a_missing_text_field_names_the_fix_each_command_takes(tmp_path, tokenizer_path):
    lines = (ROOT / "train" / "sample" / "bn.txt").read_text(encoding="utf-8").splitlines()
    body = tmp_path / "body.jsonl"
    body.write_text("".join(json.dumps({"body": t}) + "\n" for t in lines if t.strip()))
    tok = ["tokenizer", "--data", str(body), "--out", str(tmp_path / "tok"), "--vocab-size", "600"]
    prep = ["prepare", "--tokenizer", str(tokenizer_path), "--data", str(body), "--quiet"]
    prep += ["--out", str(tmp_path / "shards"), "--val-fraction", "0.1"]
    for args in (tok, prep):  # the fix the message names is the one that works
        one_line_error(run(*args, check=False), f"{body}:1: no 'text' field", "--set text_field=")
        run(*args, "--set", "text_field=body")
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    assert (tmp_path / "shards" / "meta.json").is_file()
    fert = ["fertility", "--tokenizer", str(tokenizer_path), "--text", str(body)]
    one_line_error(run(*fert, check=False), "no 'text' field", "--text-field NAME")
    assert "fertility of" in run(*fert, "--text-field", "body").stdout
    folder = small_model(tmp_path / "model", tokenizer_path)
    err = one_line_error(run("eval", str(folder), "--text", str(body), check=False), body)
    assert "eval reads the 'text' field: pass .txt files" in err and "--set" not in err


def test_fit_needs_a_config_unless_its_run_folder_recorded_one(tmp_path, shards):
    report = "import atexit, sys; atexit.register(lambda: print('torch' in sys.modules)); "
    for command in ("fit", "check-gradients", "verify"):
        args = [command, "--data", str(shards)]
        args += ["--out", str(tmp_path / command)] if command != "check-gradients" else []
        proc = run(*args, check=False, pre=report)
        one_line_error(proc, f"{command} needs --config: a preset (", "tiny", "small")
        assert proc.stdout.strip() == "False"  # refused before torch loads
    assert not (tmp_path / "fit").exists()


def test_the_moved_commands_name_their_new_home(capsys):
    from doel.train.cli import main

    for name in ("demo", "recipe"):
        with pytest.raises(SystemExit) as e:
            main([name, "--dry-run"])
        assert f"`doel {name}`" in str(e.value.code)
