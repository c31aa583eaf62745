"""turbospec.augment: training prompts written with the target (self-instruct requests, summaries,
questions over passages, translations both ways, follow-up turns), reproducible from the seed and
readable by ``turbospec train --data``."""
from __future__ import annotations

import json

import pytest

import turbospec
from turbospec import augment
from turbospec.train.data import read_prompts

from helpers import make_byte_tokenizer, make_tiny_model

CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PASSAGE = ("The river rises in the hills to the north of the town. It flows south through farmland for "
           "forty miles. Mills were built along its banks in the last century. Most of them are closed now. "
           "Today the river is known for its fish and its quiet walking paths. Visitors come every summer.")
PROMPTS = [PASSAGE, "What is 2 + 3?", "Name a colour. " + PASSAGE.replace("river", "canal"),
           [{"role": "user", "content": "hi"}]]


@pytest.fixture(scope="module")
def eng():
    tok = make_byte_tokenizer()
    tok.chat_template = CHATML
    target = turbospec.load_model(make_tiny_model("llama", seed=11))
    return turbospec.Engine(target, tokenizer=tok, drafter="ngram", max_seq_len=1024, max_batch=4)


def test_text_helpers():
    ps = augment.passages(PROMPTS, min_chars=100, max_chars=200)
    assert len(ps) == 2 and all(100 <= len(p) <= 200 and p.endswith(".") for p in ps)
    assert augment.passages(PROMPTS, min_chars=1000) == []
    ss = augment.sentences([PASSAGE])
    assert ss[0] == "The river rises in the hills to the north of the town." and all(s.endswith(".") for s in ss)
    assert augment.parse_counts("self_instruct=3, translate=2") == {"self_instruct": 3, "translate": 2}
    with pytest.raises(ValueError, match=r"--kinds: \['poems'\] are not known"):
        augment.parse_counts("poems=3")
    with pytest.raises(ValueError, match="expected KIND=COUNT"):
        augment.parse_counts("summarize")


def test_user_turn_prefix(eng):
    prefix = augment.user_turn_prefix(eng.tokenizer)
    assert eng.tokenizer.decode(prefix) == "<|user|>\n"
    tok = make_byte_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"  # drops the text
    with pytest.raises(ValueError, match="does not show the user's text"):
        augment.user_turn_prefix(tok)


def test_augment_every_kind_reproducible_and_readable(eng, tmp_path):
    counts = {"self_instruct": 24, "summarize": 3, "passage_qa": 3, "translate": 4, "follow_up": 2}
    aug = augment.Augmenter(eng, PROMPTS, seed=1, max_new_tokens=40)
    aug._passages = augment.passages(PROMPTS, min_chars=100)  # the tiny prompts' passages are short
    recs = aug.run(counts)
    by = {}
    for r in recs:
        by.setdefault(r["source"], []).append(r["prompt"])
    assert len(by["augment/summarize"]) == 3 and all(PASSAGE[:40] in p or "canal" in p for p in by["augment/summarize"])
    assert len(by["augment/translate"]) >= 2  # the requests into a language; back-translations that finished
    assert any(p.startswith(("Translate", "How do you say")) for p in by["augment/translate"])
    assert len(by["augment/follow_up"]) == 2
    for conv in by["augment/follow_up"]:
        assert [m["role"] for m in conv] == ["user", "assistant", "user"] and conv[2]["content"] in augment.FOLLOW_UPS
    # self-instruct keeps only requests the target finished (EOS before the length limit)
    assert 0 < len(by.get("augment/self_instruct", [])) < 24
    # the same seed gives the same prompts; another seed others
    again = augment.Augmenter(eng, PROMPTS, seed=1, max_new_tokens=40)
    again._passages = aug._passages
    assert again.run(counts) == recs
    other = augment.Augmenter(eng, PROMPTS, seed=2, max_new_tokens=40)
    other._passages = aug._passages
    assert other.run({"self_instruct": 24}) != [r for r in recs if r["source"] == "augment/self_instruct"]
    # written as JSONL with its provenance; turbospec train reads it back
    path = str(tmp_path / "aug.jsonl")
    augment.write(recs, path, {"seed": 1})
    meta = json.load(open(path + ".json"))
    assert meta["records"] == len(recs) and meta["seed"] == 1
    back = read_prompts(path)
    assert len(back) == len(recs)
    assert [p for p in back if isinstance(p, list)] == by["augment/follow_up"]


def test_bad_counts_name_the_kind(eng):
    aug = augment.Augmenter(eng, PROMPTS)
    with pytest.raises(ValueError, match=r"augment kinds \['haiku'\] are not known"):
        aug.run({"haiku": 1})
    with pytest.raises(ValueError, match="augment count for summarize must be an integer >= 0, got -1"):
        aug.run({"summarize": -1})
    with pytest.raises(ValueError, match="no passages"):
        augment.Augmenter(eng, ["short"]).run({"summarize": 1})
