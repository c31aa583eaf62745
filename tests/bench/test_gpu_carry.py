"""bench/gpu_carry.py: the real model and the prompts cut into device calls under the size limit,
joined there into a model directory turbospec loads (config.json + tokenizer + the GGUF, no dense
weights), and files sent back in parts. Everything but the GPU runs here."""
import importlib.util
import json
import os
import shutil

import pytest
import torch

import turbospec
from turbospec.model import loader
from helpers import shared_data


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("gpu_carry", os.path.join(ROOT, "bench", "gpu_carry.py"))
gpu_carry = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_carry)
MIB = gpu_carry.MIB


def test_plan_calls_fills_each_call_and_keeps_files_whole():
    calls = gpu_carry.plan_calls([("a", 3 * MIB), ("b", 4 * MIB)], 20 * MIB, room=10 * MIB)
    sizes = [sum(item[-1] for item in call) for call in calls]
    assert sizes == [10 * MIB, 10 * MIB, 7 * MIB]
    assert calls[0][:2] == [("file", "a", 3 * MIB), ("file", "b", 4 * MIB)]
    parts = [item for call in calls for item in call if item[0] == "part"]
    assert [p[1] for p in parts] == [0, 1, 2]
    assert [p[2] for p in parts] == [0, 3 * MIB, 13 * MIB]            # offsets: contiguous
    # a file too large for any call, and no room at all, are errors that say so
    with pytest.raises(ValueError, match="does not fit in one call"):
        gpu_carry.plan_calls([("big", 11 * MIB)], MIB, room=10 * MIB)
    with pytest.raises(ValueError, match="no room to carry anything"):
        gpu_carry.plan_calls([], MIB, room=1000)


@pytest.fixture(scope="module")
def carried(tmp_path_factory, smollm2_dir):
    """The default model packed with the repository made to take most of each call (so the GGUF
    goes in several parts), every call stashed, and joined: (carry folder, room per call)."""
    tmp = tmp_path_factory.mktemp("carry")
    data = tmp / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "hi"}) + "\n")
    out = tmp / "carry_out"
    room = 40 * MIB
    gpu_carry.main(["pack", "--data", str(data), "--dir", str(out), "--margin-mib", "0",
                    "--repo-bytes", str(gpu_carry.CALL_LIMIT - room)])
    carry = tmp / "carry"
    for call in sorted(out.iterdir()):
        gpu_carry.main(["stash", str(call), "--carry", str(carry)])
    gpu_carry.main(["join", "--carry", str(carry)])
    return out, carry, room


def test_pack_stash_join_gives_the_same_model(carried, smollm2_dir):
    """Each call's share fits; the joined directory loads (weights from the GGUF, config and
    tokenizer beside it) and computes the default model's logits bit for bit."""
    out, carry, room = carried
    calls = sorted(out.iterdir())
    assert len(calls) == 3  # 94 MiB in 40 MiB calls
    for call in calls:
        size = sum(p.stat().st_size for p in call.rglob("*") if p.is_file())
        assert size <= room
    assert (carry / "data" / "prompts.jsonl").is_file()
    model_dir = carry / "model"
    assert not list(carry.glob("gguf.part*"))
    assert loader.gguf_path(model_dir) is not None and loader.resolve_model_dir(model_dir) == str(model_dir)

    ids = torch.tensor([[1, 2, 3, 4, 5]])
    logits = []
    for source in (turbospec.default_model_path(), str(model_dir)):
        model = loader.load_model(source)
        logits.append(model.forward(ids, torch.arange(5)[None], model.new_cache(8), 0))
    assert torch.equal(logits[0], logits[1])
    assert turbospec.load_tokenizer(str(model_dir)).encode("hello") == turbospec.load_tokenizer(smollm2_dir).encode("hello")


def test_hf_model_from_the_carried_directory(carried, smollm2_hf):
    """loader.load_hf_model builds the transformers model from turbospec's GGUF reader (the GPU machine
    has no gguf package): the same weights transformers' own GGUF conversion loads."""
    hf = loader.load_hf_model(carried[1] / "model")
    mine, ref = hf.state_dict(), smollm2_hf.state_dict()
    assert set(mine) == set(ref)
    assert all(torch.equal(mine[k], ref[k]) for k in ref)


def test_bench_gpu_real_weights_on_spec_bench(carried, tmp_path):
    """bench_gpu.py's e2e section on the carried real model and the Spec-Bench sample (CPU, float32):
    turbospec's greedy tokens equal HF generate's on every prompt, and the report says real weights."""
    import subprocess
    import sys
    spec_bench = shared_data("specbench_dev.jsonl")
    if spec_bench is None:
        pytest.skip("no Spec-Bench sample in ../shared/data")
    out = tmp_path / "real.md"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_gpu.py"), "--device", "cpu", "--models", "smollm2_135m",
           "--sections", "e2e", "--real-model", str(carried[1] / "model"), "--spec-bench", spec_bench,
           "--spec-per-category", "1", "--dtype", "float32", "--max-new-tokens", "6", "--repeats", "1",
           "--systems", "hf_plain,ts_eager,ts_ngram", "--threads", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "real.json").read_text())
    m = data["models"]["smollm2_135m"]
    assert m["summary"]["weights"].startswith("real")
    e2e = m["e2e"]
    assert e2e["num_prompts"] == 6 and "Spec-Bench sample" in e2e["prompts"]
    for system in ("ts_eager", "ts_ngram"):
        r = e2e["systems"][system]
        assert r["status"] == "ok" and r["match_hf_plain"] == 1.0, (system, r)
        assert r["new_tokens"] == 6 * 6 and r["tau"] >= 1.0


def test_join_names_what_is_missing_and_checks_the_sum(tmp_path, smollm2_dir):
    out = tmp_path / "carry_out"
    gpu_carry.main(["pack", "--data", "--dir", str(out), "--margin-mib", "0",
                    "--repo-bytes", str(gpu_carry.CALL_LIMIT - 60 * MIB)])
    calls = sorted(out.iterdir())
    assert len(calls) == 2
    carry = tmp_path / "carry"
    gpu_carry.main(["stash", str(calls[0]), "--carry", str(carry)])
    with pytest.raises(SystemExit, match="lacks .*gguf.part01.*kept warm"):
        gpu_carry.main(["join", "--carry", str(carry)])
    gpu_carry.main(["stash", str(calls[1]), "--carry", str(carry)])
    part = carry / "gguf.part01"
    raw = bytearray(part.read_bytes())
    raw[1000] ^= 1
    part.write_bytes(bytes(raw))
    with pytest.raises(SystemExit, match="differs from the original"):
        gpu_carry.main(["join", "--carry", str(carry)])
    assert not (carry / "model" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


def test_split_out_and_join_back(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"a": 1}')
    (src / "model.safetensors").write_bytes(os.urandom(300_000))
    back = tmp_path / "back"
    gpu_carry.main(["split-out", str(src / "config.json"), str(src / "model.safetensors"), "--out", str(back),
                    "--part-bytes", "100000"])
    parts = sorted(p.name for p in back.glob("bundle.tar.gz.part*"))
    assert len(parts) == 4  # ~300 kB of random bytes do not compress
    dest = tmp_path / "dest"
    gpu_carry.main(["join-back", str(back), "--dest", str(dest)])
    for name in ("config.json", "model.safetensors"):
        assert (dest / name).read_bytes() == (src / name).read_bytes()
    shutil.rmtree(dest)
    raw = bytearray((back / parts[1]).read_bytes())
    raw[0] ^= 1
    (back / parts[1]).write_bytes(bytes(raw))
    with pytest.raises(SystemExit, match="differs from what split-out wrote"):
        gpu_carry.main(["join-back", str(back), "--dest", str(dest)])
    (back / parts[2]).unlink()
    with pytest.raises(SystemExit, match="lacks"):
        gpu_carry.main(["join-back", str(back), "--dest", str(dest)])
