"""Read turbospec's EAGLE-3 export of the shipped SmolLM2 head with vLLM's speculators library
(run by tests/heads/test_speculators_export.py in a subprocess, with speculators on the path).

1. ``export_head(..., "eagle3")`` writes the head in the EAGLE-3 layout vLLM and SGLang read.
2. speculators' ``Eagle3Converter`` turns it into a speculators checkpoint (what ``vllm serve``
   takes as ``--speculative-config '{"model": <dir>, ...}'``) and validates it.
3. Both of its model classes load that checkpoint (``Eagle3Speculator``, the converter's; and
   ``Eagle3DraftModel``, the one its trainer and vLLM's speculators config path use): the config
   has the head's shapes and feature layers, and every exported tensor is there, same shape, same
   values.
4. ``Eagle3DraftModel.forward`` (one step) on the target's real features of a prompt gives the
   logits turbospec's head gives (float32, to 1e-4) and the same argmax at every position.

Prints one line per check; any mismatch raises.
"""
from __future__ import annotations

import json
import os
import tempfile

import torch
from safetensors.torch import load_file

import turbospec
from turbospec.heads.formats import export_head, load_head
from turbospec.heads.shipped import shipped_heads
from turbospec.model import loader
from turbospec.model.transformer import ModelConfig


def main() -> None:
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    from speculators.convert.eagle.eagle3_legacy_model import Eagle3Speculator
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    # the target in HF layout (config + dense safetensors), as speculators' verifier loads it
    tmp = tempfile.mkdtemp()
    target_dir = os.path.join(tmp, "target")
    loader.load_hf_model(turbospec.default_model_path()).save_pretrained(target_dir)
    loader.load_tokenizer(turbospec.default_model_path()).save_pretrained(target_dir)
    target_cfg = ModelConfig.from_hf(loader.load_hf_config(target_dir))
    head = load_head(shipped_heads()["eagle3"], target_cfg=target_cfg)
    exp, conv = os.path.join(tmp, "export"), os.path.join(tmp, "speculators")
    os.makedirs(exp)
    export_head(head, exp, "eagle3", target_cfg=target_cfg)
    with open(os.path.join(exp, "config.json")) as f:
        conf = json.load(f)
    ours = load_file(os.path.join(exp, "model.safetensors"))

    Eagle3Converter().convert(exp, conv, base_model=target_dir, validate=True,
                              eagle_aux_hidden_state_layer_ids=conf["eagle_aux_hidden_state_layer_ids"])
    print("CHECK converted + validated by speculators:", sorted(os.listdir(conv)))

    hc = head.cfg
    for cls in (Eagle3Speculator, Eagle3DraftModel):
        kw = dict(verifier=target_dir, verifier_attachment_mode="detached") if cls is Eagle3Speculator else {}
        m = cls.from_pretrained(conv, **kw)
        c = m.config
        tl = c.transformer_layer_config
        shape = (tl.hidden_size, tl.intermediate_size, tl.num_attention_heads, tl.num_key_value_heads, tl.head_dim,
                 c.draft_vocab_size, c.target_vocab_size)
        want = (hc.hidden_size, hc.intermediate_size, hc.num_heads, hc.num_kv_heads, hc.head_dim,
                hc.draft_vocab_size, hc.vocab_size)
        assert shape == want, (cls.__name__, shape, want)
        # vLLM's convention: id j = the residual stream entering layer j = turbospec's layer j - 1 output
        assert list(c.eagle_aux_hidden_state_layer_ids) == [i + 1 for i in sorted(hc.feature_layers)], \
            c.eagle_aux_hidden_state_layer_ids
        sd = m.state_dict()
        for k, v in ours.items():
            name = k.replace("midlayer.", "layers.0.")
            assert name in sd, (cls.__name__, name)
            assert sd[name].shape == v.shape, (cls.__name__, name, sd[name].shape, v.shape)
            assert torch.equal(sd[name].to(v.dtype), v), (cls.__name__, name)
        rest = sorted(set(sd) - {k.replace("midlayer.", "layers.0.") for k in ours})
        print(f"CHECK {cls.__name__}: config {shape}, feature layers {c.eagle_aux_hidden_state_layer_ids}, "
              f"{len(ours)} tensors equal; from the verifier: {rest}")

    # the same numbers through speculators' own forward
    target = turbospec.load_model(turbospec.default_model_path())
    tok = loader.load_tokenizer(turbospec.default_model_path())
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog. Speculative decoding drafts "
                                   "several tokens and verifies them in one pass.")])
    n = ids.shape[1]
    _, feats = target.forward(ids, torch.arange(n)[None], target.new_cache(n), 0, logits="none",
                              features=tuple(hc.feature_layers))
    pos = torch.arange(n - 1)[None]
    with torch.no_grad():  # feature of position t with the token after it (EAGLE-3's pairing)
        want_logits = head.logits(head.forward(feats[:, :-1], target.embed[ids[:, 1:]], pos))
    cfg = Eagle3SpeculatorConfig.from_pretrained(conv)
    cfg.transformer_layer_config._attn_implementation = "eager"  # (flex attention is its GPU default)
    m = Eagle3DraftModel.from_pretrained(conv, config=cfg).eval()
    # speculators 0.9 pins transformers <= 5.19; under newer ones from_pretrained initialises the missing
    # embedding instead of leaving it NaN, so its "load if NaN" skips it: load the verifier's explicitly
    m._load_verifier_weights(overwrite_embed_tokens=True)
    got = {}
    m.lm_head.register_forward_hook(lambda mod, i, o: got.setdefault("logits", o))
    with torch.no_grad():
        m(hidden_states=feats[:, :-1], input_ids=ids[:, 1:], document_ids=torch.zeros(1, n - 1, dtype=torch.long),
          position_ids=pos, ttt_steps=1)
    diff = (got["logits"] - want_logits).abs().max().item()
    same = bool((got["logits"].argmax(-1) == want_logits.argmax(-1)).all())
    assert diff < 1e-4 and same, (diff, same)
    print(f"CHECK Eagle3DraftModel.forward vs turbospec head: {n - 1} positions, logits max |diff| {diff:.2e}, "
          f"argmax equal")


if __name__ == "__main__":
    main()
