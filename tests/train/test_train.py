"""``turbospec train``: self-distillation of draft heads on tiny random targets.

The learning tests use a "bigram" target (attention and MLP outputs zeroed, so the greedy next token is
a fixed function of the current one): its continuations are predictable, so a head that learns must
beat its initial acceptance by a wide margin on held-out samples."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

from turbospec import Engine, cli, load_model
from turbospec.heads import formats as checkpoints
from turbospec.train import config, objectives
from turbospec.train import data as distill
from turbospec.train import trainer as train
from turbospec.heads.formats import build_head
from turbospec.heads.config import HeadConfig
from turbospec.heads.layers import head_cache, init_weights

from helpers import make_tiny_model, make_tiny_tokenizer

VOCAB = 64


def _save_target(path, vocab=VOCAB, bigram=False, **kw):
    model = make_tiny_model("llama", seed=0, vocab_size=vocab, **kw)
    if bigram:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.zero_()
    model.save_pretrained(str(path))
    make_tiny_tokenizer(vocab).save_pretrained(str(path))
    return str(path)


def _write_prompts(path, n, vocab=VOCAB, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            words = " ".join(f"w{rng.randrange(vocab)}" for _ in range(rng.randrange(3, 12)))
            rec = {"source": "test", "prompt": words} if i % 3 else {"text": words}
            f.write(json.dumps(rec) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    d = tmp_path_factory.mktemp("bigram")
    return _save_target(d / "model", bigram=True), _write_prompts(d / "prompts.jsonl", 40), d


def _args(method, target, data, out, work, *extra):
    return ["train", "--method", method, "--target", target, "--data", data, "--out", str(out),
            "--work-dir", str(work), "--num-prompts", "40", "--max-new-tokens", "32", "--epochs", "10",
            "--batch-size", "8", "--lr", "3e-3", "--eval-every", "20", "--eval-samples", "8",
            "--draft-vocab", "48", "--threads", "1", *extra]


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3"])
def test_pipeline_end_to_end_learns(bigram, method, capsys):
    target, data, d = bigram
    out = d / f"head-{method}"
    assert cli.main(_args(method, target, data, out, d / "work")) == 0
    err = capsys.readouterr().err
    assert "eval at init" in err and "eval final" in err

    head = checkpoints.load_head(str(out))
    assert head.cfg.method == method
    extra = head.extra
    for key in ("command", "dataset", "num_samples", "run_time_s", "machine", "date", "eval", "eval_history"):
        assert key in extra, key
    assert extra["command"].startswith("turbospec train --method " + method)
    assert extra["dataset"] == os.path.abspath(data)
    assert extra["num_samples"] == 32 and extra["num_eval_samples"] == 8
    assert extra["machine"]["cpu_count"] and extra["partial"] is False
    assert len(extra["eval_history"]) >= 3  # init, periodic, final

    init, final = extra["eval_history"][0], extra["eval"]
    assert init["step"] == 0 and final["step"] == extra["total_steps"] == 40
    # Learning: held-out acceptance at +1 and the mean accepted chain length rise by a wide margin.
    assert final["acceptance"][0] >= init["acceptance"][0] + 0.5, (init, final)
    assert final["mean_accepted"] >= init["mean_accepted"] + 1.5, (init, final)
    assert final["ce"][0] < init["ce"][0] - 2.0
    if method == "medusa":
        table = extra["head_accuracy"]
        assert len(table) == 4 and all(len(row) == 8 for row in table)
        assert all(sum(row) <= 1 + 1e-6 for row in table)
        assert table[0][0] == pytest.approx(final["top1"][0], abs=0.05)
    if method == "eagle3":
        assert head.cfg.draft_vocab_size == 48 and head.draft_vocab_ids().numel() == 48
        assert extra["draft_vocab_coverage"] > 0.9

    # The saved head really is the trained one: re-evaluating it gives the recorded acceptance.
    store = distill.FeatureStore(*_manifest(d / "work", method))
    t = load_model(target)
    fz = objectives.Frozen(t.embed.float(), objectives.lm_head_weight(t).float(), None)
    if method == "eagle3":
        ids = head.draft_vocab_ids()
        fz.t2d = torch.full((VOCAB,), -100, dtype=torch.int64)
        fz.t2d[ids] = torch.arange(ids.numel())
    cfg = config.TrainConfig(method=method, out=str(out))
    ev = objectives.Method(head.float().train(), fz, cfg, 1.0).evaluate(store.eval_batches(8), "cpu")
    assert ev["acceptance"] == pytest.approx(final["acceptance"], abs=0.03)  # final ran under autocast


def _manifest(work, method):
    spec = "final" if method != "eagle3" else [0, 1]
    for d in sorted(os.listdir(work)):
        p = os.path.join(work, d, "manifest.json")
        if d.startswith("feat-") and os.path.isfile(p):
            with open(p) as f:
                m = json.load(f)
            if m["settings"]["spec"] == spec:
                return os.path.join(work, d), m
    raise AssertionError("no feature folder")


def test_generation_and_features_are_reused(tmp_path):
    target = _save_target(tmp_path / "m")
    data = _write_prompts(tmp_path / "p.jsonl", 6)
    cfg = dict(method="eagle", out=str(tmp_path / "o"), target=target, data=data, num_prompts=6,
               max_new_tokens=8, eval_samples=1, stop_after="features", threads=1)
    s1 = train.run(config.TrainConfig(**cfg))
    assert s1["generation"]["generated"] == 6
    samples = os.path.join(s1["generation_dir"], "samples.jsonl")
    shard = os.path.join(s1["features_dir"], "train-00000.safetensors")
    mtimes = os.path.getmtime(samples), os.path.getmtime(shard)
    s2 = train.run(config.TrainConfig(**cfg))
    assert s2["generation"]["generated"] == 0 and s2["generation"]["reused"] == 6
    assert (os.path.getmtime(samples), os.path.getmtime(shard)) == mtimes
    # A different setting is a different generation; an interrupted one resumes.
    s3 = train.run(config.TrainConfig(**{**cfg, "max_new_tokens": 9, "stop_after": "generate"}))
    assert s3["generation_dir"] != s1["generation_dir"] and s3["generation"]["generated"] == 6
    path = os.path.join(s3["generation_dir"], "samples.jsonl")
    with open(path) as f:
        lines = f.readlines()
    with open(path, "w") as f:
        f.writelines(lines[:4] + [lines[4][:10]])  # 4 whole samples and a torn line
    os.remove(os.path.join(s3["generation_dir"], "meta.json"))
    s4 = train.run(config.TrainConfig(**{**cfg, "max_new_tokens": 9, "stop_after": "generate"}))
    assert s4["generation"]["generated"] == 2
    assert sorted(s["index"] for s in distill.read_samples(path)) == list(range(6))


def test_interrupted_training_resumes_exactly(tmp_path, bigram, monkeypatch):
    """Ctrl-C leaves a usable partial head; --resume then ends exactly where an uninterrupted run
    ends (same batches, optimizer, schedule and noise)."""
    from safetensors.torch import load_file
    target, data, d = bigram
    base = _args("eagle", target, data, tmp_path / "a", d / "work", "--eval-every", "0")
    base[base.index("--epochs") + 1] = "2"
    assert cli.main(base) == 0
    ref = load_file(str(tmp_path / "a" / "model.safetensors"))

    argv = _args("eagle", target, data, tmp_path / "b", tmp_path / "work", "--eval-every", "0")
    argv[argv.index("--epochs") + 1] = "2"
    calls = {"n": 0}
    real_loss = objectives.Method.loss

    def interrupted(self, batch):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real_loss(self, batch)
    monkeypatch.setattr(objectives.Method, "loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli.main(argv)
    partial = checkpoints.load_head(str(tmp_path / "b"))
    assert partial.extra["partial"] is True and partial.extra["steps"] == 5
    monkeypatch.setattr(objectives.Method, "loss", real_loss)
    assert cli.main(argv + ["--resume"]) == 0
    got = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert checkpoints.load_head(str(tmp_path / "b")).extra["steps"] == 8
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


def test_resume_continues_training(tmp_path, bigram):
    target, data, d = bigram
    out = tmp_path / "o"
    base = _args("medusa", target, data, out, d / "work")
    base[base.index("--epochs") + 1] = "2"
    base[base.index("--eval-every") + 1] = "0"
    assert cli.main(base + ["--save-every", "4"]) == 0
    assert checkpoints.load_head(str(out)).extra["steps"] == 8
    # resuming a finished run does no further step and keeps its result
    s = train.run(config.config_from_args(_parse(base + ["--resume"])))
    assert s["steps"] == 8


@pytest.mark.parametrize("method, extra", [
    ("eagle", ["--loss-on-prompt", "--ttt-steps", "2", "--feature-noise", "0.1", "--schedule", "linear",
               "--warmup-steps", "2", "--amp", "none"]),
    ("eagle3", ["--loss-on-prompt", "--ttt-steps", "1", "--feature-layers", "1", "--eval-samples", "0",
                "--schedule", "constant", "--amp", "bfloat16"]),
])
def test_options_run(tmp_path, bigram, method, extra):
    target, data, d = bigram
    argv = _args(method, target, data, tmp_path / "o", d / "work", *extra)
    argv[argv.index("--epochs") + 1] = "1"
    assert cli.main(argv) == 0
    head = checkpoints.load_head(str(tmp_path / "o"))
    assert head.extra["steps"] == head.extra["total_steps"] > 0
    if "--eval-samples" in extra:
        assert head.extra["eval"] is None and head.extra["num_eval_samples"] == 0
        assert head.cfg.feature_layers == [1]


def _parse(argv):
    import argparse
    p = argparse.ArgumentParser()
    config.add_args(p)
    return p.parse_args(argv[1:])


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_unrolled_steps_see_what_drafting_sees(method):
    """The training-time-test forward equals drafting one token at a time with a KV cache:
    chain i at step j attends to step-0 keys 0..i and its own steps 1..j, nothing else."""
    torch.manual_seed(0)
    t = load_model(make_tiny_model("llama", vocab_size=VOCAB))
    hcfg = HeadConfig.for_target(method, t.cfg, feature_layers=[0, 1]) if method == "eagle3" else \
        HeadConfig.for_target(method, t.cfg)
    head = build_head(hcfg)
    init_weights(head, std=0.2)
    n, steps = 9, 3
    width = hcfg.hidden_size * (2 if method == "eagle3" else 1)
    feats = torch.randn(1, n, width)
    ids = torch.randint(0, VOCAB, (1, n))
    embed = t.embed.float()
    with torch.no_grad():
        outs = objectives.unroll(head, feats, ids, embed, steps)
        for i in range(n - steps):
            kv = head_cache(hcfg, n + steps)
            o = head(feats[:, :i + 1], embed[ids[:, 1:i + 2]], torch.arange(i + 1)[None], kv=kv, cache_len=0)
            got = [o[:, -1]]
            for j in range(1, steps):
                o = head(got[-1][:, None], embed[ids[:, i + 1 + j]][:, None], torch.tensor([[i + j]]), kv=kv,
                         cache_len=i + j, fused=True)
                got.append(o[:, -1])
            for j in range(steps):
                torch.testing.assert_close(outs[j][:, i], got[j], rtol=1e-4, atol=1e-4)


def test_unrolled_gradients_do_not_leak_future():
    torch.manual_seed(0)
    t = load_model(make_tiny_model("llama", vocab_size=VOCAB))
    hcfg = HeadConfig.for_target("eagle3", t.cfg, feature_layers=[0, 1])
    head = build_head(hcfg)
    init_weights(head, std=0.2)
    feats = torch.randn(1, 8, 2 * hcfg.hidden_size, requires_grad=True)
    ids = torch.randint(0, VOCAB, (1, 8))
    outs = objectives.unroll(head, feats, ids, t.embed.float(), 3)
    i = 3
    outs[2][0, i].sum().backward()
    g = feats.grad[0].abs().sum(-1)
    assert (g[:i + 1] > 0).all() and (g[i + 1:] == 0).all()


def test_greedy_batch_matches_engine():
    t = load_model(make_tiny_model("llama"))
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (3, 9, 5, 1, 12)]
    eng = Engine(t, drafter="none", max_seq_len=64)
    got = distill.greedy_batch(t, prompts, 10, eos_token_ids={7})
    for p, (resp, fin) in zip(prompts, got):
        ref = []
        for tok in eng.generate(p, max_new_tokens=10).token_ids:
            ref.append(tok)
            if tok == 7:
                break
        assert resp == ref
        assert fin == ("eos" if resp[-1] == 7 else "length")


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_weight_is_exact(tied):
    hf = make_tiny_model("llama", tie_word_embeddings=tied)
    t = load_model(hf)
    assert torch.equal(objectives.lm_head_weight(t), hf.lm_head.weight.detach())
    if hasattr(t, "lm_head_weight"):  # the fallback: the LM head's own (dense) weight
        del t.lm_head_weight
        assert torch.equal(objectives.lm_head_weight(t), hf.lm_head.weight.detach())


def test_prompt_formats():
    assert distill.prompt_of({"prompt": "hi"}) == "hi"
    assert distill.prompt_of({"text": "yo"}) == "yo"
    assert distill.prompt_of({"turns": ["first", "second"]}) == "first"
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert distill.prompt_of({"messages": msgs}) == [{"role": "user", "content": "q"}]
    assert distill.prompt_of({"conversations": [{"from": "human", "value": "q"}]}) == \
        [{"role": "user", "content": "q"}]
    assert distill.prompt_of({"other": 1}) is None


# ---------------------------------------------------------------------------------------------
def test_bad_inputs_name_the_parameter(tmp_path, capsys):
    target = _save_target(tmp_path / "m")
    data = _write_prompts(tmp_path / "p.jsonl", 3)
    cfg = dict(method="eagle3", out=str(tmp_path / "o"), target=target, data=data, threads=1)
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="--data.*nope.jsonl"):
        train.run(config.TrainConfig(**{**cfg, "data": missing}))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="--data.*empty"):
        train.run(config.TrainConfig(**{**cfg, "data": str(empty)}))
    useless = tmp_path / "useless.jsonl"
    useless.write_text('{"foo": 1}\n')
    with pytest.raises(ValueError, match="--data.*'prompt'"):
        train.run(config.TrainConfig(**{**cfg, "data": str(useless)}))
    with pytest.raises(ValueError, match="--method 'lora'"):
        train.run(config.TrainConfig(**{**cfg, "method": "lora"}))
    with pytest.raises(ValueError, match="--draft-vocab 300 .*vocabulary \\(64\\)"):
        train.run(config.TrainConfig(**{**cfg, "draft_vocab": 300}))
    with pytest.raises(ValueError, match="--loss-on-prompt"):
        train.run(config.TrainConfig(**{**cfg, "method": "medusa", "loss_on_prompt": True}))
    with pytest.raises(ValueError, match="--epochs must be an integer >= 1, got 0"):
        train.run(config.TrainConfig(**{**cfg, "epochs": 0}))
    with pytest.raises(ValueError, match="--data .*evaluation data"):
        spec = tmp_path / "specbench_dev.jsonl"
        spec.write_text('{"turns": ["q"]}\n')
        train.run(config.TrainConfig(**{**cfg, "data": str(spec)}))
    # the command line: exit status 2 and the message
    assert cli.main(["train", "--method", "eagle", "--target", target, "--data", missing,
                     "--out", str(tmp_path / "o")]) == 2
    assert "--data" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--method", "lora", "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and "--method" in capsys.readouterr().err


def test_train_help_lists_options(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--method", "--target", "--data", "--out", "--work-dir", "--num-prompts", "--max-new-tokens",
                "--max-prompt-tokens", "--seed", "--epochs", "--lr", "--batch-size", "--eval-every",
                "--ttt-steps", "--draft-vocab", "--device", "--threads", "--resume", "--feature-noise"):
        assert opt in out, opt
