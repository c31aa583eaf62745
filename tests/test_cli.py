"""The `turbospec` command line: generate prints the completion and its stats; bad input exits 2
with a message naming the parameter."""
from __future__ import annotations

import json

import pytest

from turbospec import cli


def test_generate_prints_completion_and_stats(smollm2_dir, capsys):
    rc = cli.main(["generate", "Repeat exactly: red green blue red green blue", "--model", smollm2_dir,
                   "--max-new-tokens", "24", "--threads", "1"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.strip(), "no completion printed"
    assert "tok/s" in err and "tau" in err and "verify steps" in err


@pytest.mark.parametrize("model", ["converted_dir", "gguf", "default"])
def test_generate_matches_engine(smollm2_dir, smollm2, capsys, model):
    """What users pass: the default model's .gguf path, "default" (the option's default) and the
    converted directory all give the engine's output."""
    import turbospec
    target, tok = smollm2
    ref = turbospec.Engine(target, drafter="none", tokenizer=tok).generate("Name three colours.",
                                                                            max_new_tokens=20)
    path = {"converted_dir": smollm2_dir, "gguf": turbospec.default_model_path(), "default": None}[model]
    argv = ["generate", "Name three colours.", "--drafter", "ngram", "--max-new-tokens", "20", "--threads", "1"]
    assert cli.main(argv + ([] if path is None else ["--model", path])) == 0
    out, _ = capsys.readouterr()
    assert out.rstrip(chr(10)) == ref.text


@pytest.mark.parametrize("drafter", ["suffix", "lookahead"])
def test_generate_with_model_free_drafter_equals_plain(smollm2_dir, capsys, drafter):
    from turbospec import Engine
    prompt = "Repeat exactly: red green blue red green blue"
    assert cli.main(["generate", prompt, "--model", smollm2_dir, "--drafter", drafter, "--max-new-tokens", "16",
                     "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    assert f"drafter {drafter}" in err
    assert out.rstrip("\n") == Engine(smollm2_dir, drafter="none", max_seq_len=4096).generate(prompt, 16).text


def test_generate_with_head_suffix_hybrid_equals_plain(smollm2_dir, capsys):
    """--drafter hybrid --head DIR: the shipped EAGLE-3 head and suffix decoding in one tree."""
    from turbospec import Engine
    from turbospec.heads.shipped import shipped_heads
    prompt = "Repeat exactly: red green blue red green blue"
    assert cli.main(["generate", prompt, "--model", smollm2_dir, "--drafter", "hybrid", "--head",
                     shipped_heads()["eagle3"], "--max-new-tokens", "16", "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    assert "drafter eagle+suffix" in err
    assert out.rstrip("\n") == Engine(smollm2_dir, drafter="none", max_seq_len=4096).generate(prompt, 16).text
    rc = cli.main(["generate", prompt, "--model", smollm2_dir, "--drafter", "hybrid", "--max-new-tokens", "4"])
    assert rc == 2 and "drafter='hybrid' needs head=" in capsys.readouterr()[1]


def test_generate_logprobs_table(smollm2_dir, smollm2, capsys):
    """--logprobs N: the completion, then one line per token with its logprob and N alternatives:
    the engine's numbers without drafts."""
    import turbospec
    from turbospec.decode.text import TokenPieces
    target, tok = smollm2
    ref = turbospec.Engine(target, drafter="none", tokenizer=tok).generate(
        "Name three colours.", max_new_tokens=12, logprobs=True, top_logprobs=2)
    argv = ["generate", "Name three colours.", "--model", smollm2_dir, "--drafter", "ngram", "--max-new-tokens",
            "12", "--threads", "1", "--logprobs", "2"]
    assert cli.main(argv) == 0
    out, _ = capsys.readouterr()
    assert out.startswith(ref.text + chr(10))
    lines = out[len(ref.text):].strip().splitlines()
    assert lines[0].split()[:4] == ["#", "token", "logprob", "prob"]
    rows = lines[1:]
    assert len(rows) == len(ref.token_ids) == 12
    pieces = TokenPieces(tok)
    for i, (row, e) in enumerate(zip(rows, ref.logprobs)):
        want = (f"{i:>4}  {repr(pieces.text(e.token_id))}", f"{e.logprob:.4f}",
                *(f"{repr(pieces.text(t))} {lp:.4f}" for t, lp in e.top))
        assert row.startswith(want[0]) and all(w in row for w in want[1:]), (row, want)


@pytest.mark.parametrize("args, needle", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-k", "-2"], "top_k"),
    (["--max-new-tokens", "0"], "max-new-tokens"),
    (["--threads", "-1"], "--threads"),
    (["--threads", "0"], "--threads"),
    (["--max-seq-len", "1"], "--max-seq-len"),
    (["--max-seq-len", "100000000"], "max_position_embeddings (8192)"),  # refused before loading
    (["--logprobs", "21"], "--logprobs"),
    (["--logprobs", "-1"], "--logprobs"),
    (["--presence-penalty", "3"], "presence_penalty"),
    (["--repetition-penalty", "0"], "repetition_penalty"),
    (["--min-p", "2"], "min_p"),
    (["--logit-bias", "[1]"], "--logit-bias"),
    (["--logit-bias", '{"5": 500}'], "logit_bias[5]"),
    (["--regex", "(a"], "regex"),
    (["--regex", "a", "--choice", "b"], "at most one of --json-schema"),
    (["--json-schema", "{oops"], "--json-schema must be a JSON schema"),
    (["--prefix-cache-mb", "-1"], "--prefix-cache-mb"),
])
def test_generate_bad_input_exits_2(smollm2_dir, capsys, args, needle):
    rc = cli.main(["generate", "hello", "--model", smollm2_dir, *args])
    _, err = capsys.readouterr()
    assert rc == 2
    assert needle in err


def test_missing_model_exits_2(tmp_path, capsys):
    rc = cli.main(["generate", "hello", "--model", str(tmp_path / "nope")])
    _, err = capsys.readouterr()
    assert rc == 2 and "nope" in err


def test_generate_structured_and_penalized(smollm2_dir, tmp_path, capsys):
    """--json-schema FILE (and --choice, --frequency-penalty, --logit-bias): the engine's output
    without drafts, printed; the JSON validates."""
    import json

    import jsonschema
    from turbospec import Engine
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["colour", "count"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    prompt = "Pick a colour and a count, as JSON."
    plain = Engine(smollm2_dir, drafter="none", max_seq_len=4096)
    assert cli.main(["generate", prompt, "--model", smollm2_dir, "--drafter", "ngram", "--max-new-tokens", "40",
                     "--threads", "1", "--json-schema", str(path)]) == 0
    out, _ = capsys.readouterr()
    jsonschema.validate(json.loads(out.strip()), schema)
    assert out.strip() == plain.generate(prompt, 40, grammar={"json_schema": schema}).text
    assert cli.main(["generate", "Is the sky blue?", "--model", smollm2_dir, "--max-new-tokens", "8", "--threads", "1",
                     "--choice", "yes", "--choice", "no"]) == 0
    assert capsys.readouterr()[0].strip() in ("yes", "no")
    argv = ["generate", "Repeat exactly: red green blue red green blue", "--model", smollm2_dir, "--drafter", "ngram",
            "--max-new-tokens", "16", "--threads", "1", "--frequency-penalty", "1.5", "--logit-bias", '{"28": 2.0}']
    assert cli.main(argv) == 0
    want = plain.generate("Repeat exactly: red green blue red green blue", 16, frequency_penalty=1.5,
                          logit_bias={28: 2.0})
    assert capsys.readouterr()[0].rstrip("\n") == want.text


def test_augment_writes_prompts_train_reads(smollm2_dir, tmp_path, capsys):
    """`turbospec augment` on the real model: self-instruct requests it finished, summaries and
    translations, with provenance; `turbospec train --data` reads the file."""
    from turbospec.train.data import read_prompts
    data = tmp_path / "prompts.jsonl"
    passage = ("The library opened in 1902 with a gift from a local merchant. It held four thousand books "
               "at first. A new wing was added in 1960 for children. Today it lends music and films too. ") * 2
    data.write_text(json.dumps({"prompt": passage}) + "\n" + json.dumps({"prompt": "What is a library?"}) + "\n")
    out = tmp_path / "aug.jsonl"
    rc = cli.main(["augment", "--model", smollm2_dir, "--data", str(data), "--out", str(out), "--drafter", "ngram",
                   "--kinds", "self_instruct=3,summarize=2,translate=2", "--max-new-tokens", "64", "--threads", "1"])
    assert rc == 0 and "prompts to" in capsys.readouterr().out
    meta = json.loads((tmp_path / "aug.jsonl.json").read_text())
    assert meta["kinds"] == {"self_instruct": 3, "summarize": 2, "translate": 2} and meta["data_sha1"]
    assert meta["by_source"]["augment/summarize"] == 2 and meta["by_source"].get("augment/self_instruct", 0) >= 1
    assert len(read_prompts(str(out))) == meta["records"]
    assert cli.main(["augment", "--model", smollm2_dir, "--data", str(data), "--out", str(out),
                     "--kinds", "poems=1"]) == 2
    assert "not known" in capsys.readouterr().err
