"""``turbospec serve`` as a user runs it: the real default model (SmolLM2-135M-Instruct) in a
subprocess on a free port, a chat completion through the official client equal to the same
conversation decoded alone (fp32 greedy); bad options refused before anything loads."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the serving extras are not installed (.ci/run installs them)")
from turbospec import Engine, cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("argv, word", [(["--max-batch", "0"], "--max-batch"), (["--port", "70000"], "--port"),
                                        (["--max-waiting", "-1"], "--max-waiting"),
                                        (["--prefill-chunk", "-5"], "--prefill-chunk"),
                                        (["--api-key", ""], "--api-key"), (["--api-key-all"], "--api-key-all")])
def test_bad_options(argv, word, capsys):
    assert cli.main(["serve", *argv]) == 2
    assert word in capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_default_model_chat_equals_alone(smollm2):
    target, tok = smollm2
    messages = [{"role": "user", "content": "Name three colors."}]
    want = Engine(target, drafter="none", tokenizer=tok, max_seq_len=512).generate(messages, max_new_tokens=24)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "turbospec.cli", "serve", "--port", str(port), "--max-batch", "2",
                             "--max-seq-len", "512", "--threads", "1", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            if proc.poll() is not None:
                pytest.fail(f"turbospec serve exited: {proc.stdout.read()}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        [model] = client.models.list().data
        assert model.id == "SmolLM2-135M-Instruct"
        r = client.chat.completions.create(model=model.id, messages=messages, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == want.text
        assert r.usage.completion_tokens == len(want.token_ids)
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        proc.terminate()  # SIGTERM: a clean shutdown (the engine steps on the main thread, uvicorn beside it)
        assert proc.wait(timeout=30) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_serve_port_in_use_exits_nonzero(smollm2):
    """A port already taken: uvicorn's error is printed and turbospec serve exits with status 1 (the
    engine's worker on the main thread ends with it; nothing hangs)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        r = subprocess.run([sys.executable, "-m", "turbospec.cli", "serve", "--port", str(port), "--max-batch", "1",
                            "--threads", "1", "--log-level", "warning"], env=env, capture_output=True, text=True,
                           timeout=300)
    assert r.returncode == 1, r.stderr
    assert "address already in use" in r.stderr
