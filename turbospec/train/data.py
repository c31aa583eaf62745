"""Self-distillation data for draft heads (stages 1 and 2 of ``turbospec train``).

Stage 1, ``generate``: training prompts (JSONL) get the target's chat template (``decode.text.encode``)
and the TARGET answers them greedily (or sampled at ``--gen-temperature``), in batches (left-padded
prompts, one attention mask per row, the model's own layer loop), so a head learns the target's own distribution. Stored in
``<work>/gen-<key>/samples.jsonl`` (one ``{"index", "prompt_ids", "response_ids", "finish"}`` per
line) with ``meta.json``; ``<key>`` hashes every setting that changes the result (data file contents,
target weights, dtype, prompt count and limits, seed, temperature), so a matching run re-uses the
file and an interrupted one resumes where it stopped.

Stage 2, ``collect_features``: one fresh target pass per sample over prompt + response records what
heads read and what they must predict, in safetensors shards ``<work>/feat-<key>/``:
  features [tokens, F]   what the target's ``forward(features=...)`` returns ("final": F = hidden;
                         a layer tuple: F = len * hidden), stored in bfloat16 by default
  ids      [tokens]      int32, the sequence (prompt + response)
  argmax   [tokens]      int32, the target's greedy next token at each position (argmax of its logits)
  topk_ids, topk_logp [tokens, K]  with ``topk`` K > 0 (--distill-topk): the target's K most likely
                         next tokens (int32) and their log-probabilities over the whole vocabulary
                         (float32), the soft labels of a distillation loss
  offsets  [S + 1]       int64, sample s is rows offsets[s]:offsets[s + 1]
  prompt_len [S]         int64
The last ``eval_samples`` samples (the order is already a seeded shuffle) go to ``eval.safetensors``,
the held-out split; ``manifest.json`` lists finished shards, so this stage resumes too.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import sys
import time

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from ..model.transformer import ModelConfig, Transformer, rms_norm

PROMPT_KEYS = ("prompt", "text", "instruction", "question")
EVAL_DATA_NAMES = ("specbench", "spec_bench", "spec-bench", "humaneval", "human_eval", "human-eval")


# progress bars: redraw often on a terminal, every 5 s in a log file
BAR = dict(dynamic_ncols=True, mininterval=0.1 if sys.stderr.isatty() else 5.0)


def log(msg: str) -> None:
    """A progress line on stderr, prefixed ``[turbospec train]``."""
    print(f"[turbospec train] {msg}", file=sys.stderr, flush=True)


def sha1(obj) -> str:
    """A short key (12 hex digits) of a JSON-serialisable object (its settings)."""
    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def file_sha1(path: str) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ModelConfig fields added after fingerprints were first stored: left out while at their defaults
_LATER_FIELDS = {"sliding_window", "layer_windows", "qk_norm", "norm_layout", "activation", "embed_scale", "attn_scale",
                 "rope_local_theta", "rope_local_scaling", "num_experts", "experts_per_token", "moe_intermediate_size",
                 "moe_norm_topk", "moe_layers", "attn_softcap", "final_softcap"}


def target_fingerprint(target: Transformer) -> str:
    """Identifies the target's weights cheaply (config + a few embedding rows + final norm)."""
    # (a config field added later is left out at its default, so earlier runs' fingerprints hold)
    later = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in _LATER_FIELDS}
    h = hashlib.sha1(repr(sorted((k, v) for k, v in vars(target.cfg).items()
                                 if not (k in later and v == later[k]))).encode())
    for t in (target.embed[:8], target.embed[-8:], target.norm):
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


@contextlib.contextmanager
def stage_lock(folder: str):
    """Exclusive use of a stage folder: a second run sharing --work-dir waits here, then re-uses
    what the first one stored (POSIX file lock; no locking where fcntl is missing)."""
    os.makedirs(folder, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(os.path.join(folder, ".lock"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            log(f"waiting for another run using {folder} ...")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------
# Prompts
def prompt_of(rec):
    """A record's prompt: a string (one user turn) or a list of {"role", "content"} messages ending
    with a user turn; None when the record has none. Accepted: "prompt" / "text" / "instruction" /
    "question" (a string, or a message list), "turns" (list of strings: the first turn, as Spec-Bench /
    MT-bench store them), "messages" / "conversations" (chat messages; ShareGPT's {"from", "value"}
    too; trailing assistant turns are dropped: the target writes its own answer)."""
    if isinstance(rec, str):
        return rec or None
    if not isinstance(rec, dict):
        return None
    for key in PROMPT_KEYS:
        v = rec.get(key)
        if isinstance(v, str) and v.strip():
            return v
        if isinstance(v, list) and v and isinstance(v[0], dict):
            return _messages(v)
    turns = rec.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str) and turns[0].strip():
        return turns[0]
    for key in ("messages", "conversations"):
        v = rec.get(key)
        if isinstance(v, list) and v and isinstance(v[0], dict):
            return _messages(v)
    return None


def _messages(msgs: list[dict]):
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
             "system": "system", "model": "assistant"}
    out = []
    for m in msgs:
        role = roles.get(str(m.get("role", m.get("from", ""))).lower())
        content = m.get("content", m.get("value"))
        if role is None or not isinstance(content, str):
            return None
        out.append({"role": role, "content": content})
    while out and out[-1]["role"] == "assistant":
        out.pop()
    return out if out and out[-1]["role"] == "user" else None


def read_prompts(path: str) -> list:
    """All prompts of a JSONL file (see ``prompt_of``). Errors name --data and the file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data {path!r} does not exist (expected a JSONL file with one "
                                f"{{\"prompt\": ...}} per line)")
    base = os.path.basename(path).lower()
    if any(n in base for n in EVAL_DATA_NAMES):
        raise ValueError(f"--data {path!r} looks like evaluation data (Spec-Bench / HumanEval); "
                         f"keep evaluation prompts out of head training")
    prompts, lines = [], 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            lines += 1
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--data {path!r} line {lineno} is not JSON: {e}") from None
            p = prompt_of(rec)
            if p is not None:
                prompts.append(p)
    if lines == 0:
        raise ValueError(f"--data {path!r} is empty: expected one JSON object per line with a "
                         f"'prompt' (or 'text', 'turns', 'messages') field")
    if not prompts:
        raise ValueError(f"--data {path!r}: none of its {lines} records has a usable 'prompt', 'text', "
                         f"'instruction', 'question', 'turns' or 'messages' field")
    return prompts


def select_prompts(prompts: list, encode, num_prompts: int, max_prompt_tokens: int, seed: int,
                   truncate: bool) -> tuple[list[list[int]], int]:
    """Encode prompts in a seeded random order until ``num_prompts`` (0: all) fit
    ``max_prompt_tokens``; longer ones are skipped, or with ``truncate`` keep their last tokens
    (the end of the template, where the answer starts). Returns (token id lists, skipped count)."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    want = num_prompts or len(prompts)
    out, skipped = [], 0
    for i in order:
        if len(out) >= want:
            break
        try:
            ids = encode(prompts[i])
        except ValueError:
            skipped += 1
            continue
        if len(ids) > max_prompt_tokens:
            if not truncate:
                skipped += 1
                continue
            ids = ids[-max_prompt_tokens:]
        out.append(ids)
    if not out:
        raise ValueError(f"no prompt fits --max-prompt-tokens {max_prompt_tokens} ({skipped} skipped); "
                         f"raise it or pass --truncate-long-prompts")
    return out, skipped


# ---------------------------------------------------------------------------------------------
# Stage 1: batched generation by the target (greedy, or sampled at a temperature)
def _masked_forward(target: Transformer, ids: Tensor, pos: Tensor, cache, cache_len: int,
                    mask: Tensor) -> Tensor:
    """The target's forward with a full attention mask [B, 1, n, cache_len + n] (rows of different
    lengths share cache slots: left padding is masked per row); logits of the last position [B, V].
    Uses the model's reference layer loop, which takes any such mask."""
    cos, sin = target.rope(pos)
    x = target.embed_tokens(ids)
    x, _ = target.layers_sdpa(x, cos, sin, mask, cache, cache_len)
    x = rms_norm(x[:, -1], target.norm, target.cfg.rms_norm_eps)
    return target.lm_head(x).float()


@torch.inference_mode()
def answer_batch(target: Transformer, prompts: list[list[int]], max_new_tokens: int,
                 eos_token_ids: set[int], temperature: float = 0.0,
                 seeds: list[int] | None = None) -> list[tuple[list[int], str]]:
    """The target's continuations of several prompts at once: [(response ids, "eos" | "length")].
    The EOS token, when produced, ends (and is kept in) the response. ``temperature`` 0: greedy,
    the same tokens as ``Engine(drafter="none").generate`` up to floating-point near-ties; > 0:
    sampled from softmax(logits / temperature), row j with its own generator seeded ``seeds[j]``
    (so a prompt's draws do not depend on the batch it lands in)."""
    dev = target.device
    bsz = len(prompts)
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    L = int(lens.max())
    pad = L - lens                                              # [B] left padding per row
    ids = torch.zeros(bsz, L, dtype=torch.int64, device=dev)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = torch.tensor(p, dtype=torch.int64, device=dev)
    ar = torch.arange(L, device=dev)
    pos = (ar[None] - pad[:, None]).clamp_min(0)                # [B, L]
    key_ok = ar[None] >= pad[:, None]                            # [B, L] real (non-pad) slots
    causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril_()
    eye = torch.eye(L, dtype=torch.bool, device=dev)
    mask = (causal[None] & key_ok[:, None, :]) | eye[None]     # pad rows see themselves: no empty row
    cache = target.new_cache(L + max_new_tokens, bsz)
    logits = _masked_forward(target, ids, pos, cache, 0, mask[:, None])
    rows = list(range(bsz))                                      # original row of each live row
    out: list[list[int]] = [[] for _ in range(bsz)]
    finish = ["length"] * bsz
    gens = None
    if temperature > 0:
        if seeds is None or len(seeds) != bsz:
            raise ValueError("answer_batch: sampling (temperature > 0) needs one seed per prompt")
        gens = [torch.Generator(device=dev).manual_seed(int(sd)) for sd in seeds]
    for t in range(max_new_tokens):
        if gens is None:
            nxt = logits.argmax(-1).tolist()
        else:
            # inverse CDF: one uniform per row from its own generator, the rows' CDFs in float64
            # (torch.multinomial per row cost a quarter of the step in its logarithms)
            cdf = torch.softmax(logits.double() / temperature, dim=-1).cumsum_(-1)
            u = torch.cat([torch.rand(1, generator=gens[r], device=dev, dtype=torch.float64) for r in rows])
            u = u[:, None] * cdf[:, -1:]
            nxt = torch.searchsorted(cdf, u, right=True).clamp_max_(cdf.shape[-1] - 1)[:, 0].tolist()
        keep = []
        for j, tok in enumerate(nxt):
            out[rows[j]].append(tok)
            if tok in eos_token_ids:
                finish[rows[j]] = "eos"
            else:
                keep.append(j)
        if t == max_new_tokens - 1 or not keep:
            break
        if len(keep) < len(rows):  # drop finished rows from the batch and the cache
            idx = torch.tensor(keep, device=dev)
            cache.k = [k.index_select(0, idx) for k in cache.k]
            cache.v = [v.index_select(0, idx) for v in cache.v]
            key_ok, lens = key_ok[idx], lens[idx]
            rows = [rows[j] for j in keep]
            nxt = [nxt[j] for j in keep]
        x = torch.tensor(nxt, dtype=torch.int64, device=dev)[:, None]
        key_ok = torch.cat((key_ok, torch.ones(len(rows), 1, dtype=torch.bool, device=dev)), dim=1)
        logits = _masked_forward(target, x, (lens + t)[:, None], cache, L + t, key_ok[:, None, None, :])
    return list(zip(out, finish))



def answer_with_engine(engine, prompts: list[list[int]], max_new_tokens: list[int], temperature: float = 0.0,
                       seeds: list[int] | None = None) -> list[tuple[list[int], str]]:
    """``answer_batch`` through a ``turbospec.Engine`` (``--gen-engine batched``): the batched
    scheduler (continuous batching up to the engine's ``max_batch``, its drafter, activations and
    cache dtype), each prompt with its own ``max_new_tokens`` and, when sampling, its own seed (a
    request's draws do not depend on its neighbours). [(response ids, "eos" | "length")]; the EOS
    token, when produced, ends (and is kept in) the response, as ``answer_batch`` keeps it."""
    from ..decode.batch import Request
    if temperature > 0 and (seeds is None or len(seeds) != len(prompts)):
        raise ValueError("answer_with_engine: sampling (temperature > 0) needs one seed per prompt")
    reqs = [Request(list(p), max_new_tokens=int(m), temperature=float(temperature), top_k=0, top_p=1.0,
                    seed=None if temperature <= 0 else int(seeds[j]))
            for j, (p, m) in enumerate(zip(prompts, max_new_tokens))]
    gens = engine.generate(reqs)
    return [(list(g.token_ids), "eos" if g.finish_reason == "eos" else "length") for g in gens]

def read_samples(path: str) -> list[dict]:
    """The samples of a samples.jsonl (a torn last line from an interrupted run is ignored)."""
    out = []
    if not os.path.isfile(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return out


def generate(target: Transformer, encode, eos_token_ids: set[int], prompts: list, work_dir: str, *,
             data_sha1: str, num_prompts: int, max_new_tokens: int, max_prompt_tokens: int, seed: int,
             truncate: bool, batch_size: int, dtype: str, temperature: float = 0.0,
             stop_at: float | None = None, distill_data: str | None = None,
             provenance: dict | None = None, engine=None, answerer: dict | None = None,
             extend_data: str | None = None) -> tuple[str, list[dict], dict]:
    """Stage 1. ``encode``: prompt -> token ids (with the chat template); ``eos_token_ids``: the tokens
    that end a response. Returns (the generation folder, its samples sorted by index, info) where info
    says how many samples this call generated (0 when the stored file was re-used).
    ``stop_at`` (a ``time.perf_counter()`` value): no batch starts after it; the samples done so far
    are returned (info["complete"] False) and a later call resumes the rest.
    ``distill_data`` (a .npz, see ``save_distill``): samples stored there with the same settings
    are used (generation continues after them), and the samples afterwards are written back to it
    with ``provenance``, so a generation continues on another machine instead of restarting.
    ``engine`` (a ``turbospec.Engine`` on the target, or a function that builds one when there is
    something to answer; ``--gen-engine batched``): it answers instead of ``answer_batch``, with ``answerer`` (what changes its answers: its activations, and when
    sampling its drafter) joining the settings. ``extend_data`` (a .npz of a generation of the same
    prompts and settings with a smaller ``max_new_tokens``, ``--extend-data``): its answers are
    kept, those it cut at its length limit are continued up to ``max_new_tokens`` (its key joins the
    settings), so that a longer generation does not answer again what is stored."""
    settings = dict(data_sha1=data_sha1, target=target_fingerprint(target), dtype=dtype,
                    num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                    max_prompt_tokens=max_prompt_tokens, truncate=truncate, seed=seed, version=1)
    if temperature > 0:  # absent for greedy: the keys of greedy generations stored before stay valid
        settings["temperature"] = float(temperature)
    if answerer:  # absent for answer_batch: the keys stored before stay valid
        settings["answerer"] = dict(answerer)
    base = None
    if extend_data:
        base, base_settings = load_extended(extend_data, settings)
        settings["extends"] = {"settings_key": sha1(base_settings), "max_new_tokens": base_settings["max_new_tokens"]}
    if engine is not None:
        made = []  # engine may be a factory: the Engine is built when there is something to answer

        def answer(ps, news, seeds):
            if not made:
                made.append(engine() if callable(engine) and not hasattr(engine, "generate") else engine)
            return answer_with_engine(made[0], ps, news, temperature, seeds)
    else:
        def answer(ps, news, seeds):
            out = [None] * len(ps)  # answer_batch takes one limit: the prompts of each limit together
            for m in sorted(set(news)):
                js = [j for j, n in enumerate(news) if n == m]
                for j, r in zip(js, answer_batch(target, [ps[j] for j in js], m, eos_token_ids, temperature,
                                                 [seeds[j] for j in js])):
                    out[j] = r
            return out
    gen_dir = os.path.join(work_dir, f"gen-{sha1(settings)}")
    if distill_data:  # before generating anything: the result could not be stored there
        _check_distill_settings(distill_data, settings)
    with stage_lock(gen_dir):
        stored = 0
        if distill_data:
            stored = seed_generation(distill_data, gen_dir, settings)
        out = _generate(encode, prompts, gen_dir, settings, batch_size, answer, stop_at, base,
                        per_call=ENGINE_CALL_BATCHES if engine is not None else 1)
        # written back when the folder holds samples the file lacks: generated now, or by an
        # earlier run that was interrupted before it could store them
        if distill_data and (len(out[1]) > stored or not os.path.isfile(distill_data)):
            save_distill(distill_data, out[1], settings, {**(provenance or {}), "info": {
                k: v for k, v in out[2].items() if k not in ("generated", "reused")}})
            log(f"generation: {len(out[1])} samples stored in {distill_data}")
        return out


# ---------------------------------------------------------------------------------------------
# Self-distillation data that travels: one compressed .npz of token ids (uint16 where the
# vocabulary fits, ~2 bytes a token before compression) and a JSON beside it with the generation
# settings (which key the generation folder) and the provenance.
def _distill_json(path: str) -> str:
    return os.path.splitext(path)[0] + ".json"


def _check_distill_settings(path: str, settings: dict) -> None:
    """Refuses a stored file (when there is one) made with other generation settings."""
    if os.path.isfile(_distill_json(path)):
        with open(_distill_json(path)) as f:
            stored = json.load(f).get("settings")
        if stored != settings:
            raise ValueError(f"--distill-data {path!r} holds samples of other generation settings "
                             f"({_settings_diff(stored, settings)}); choose another path")


def save_distill(path: str, samples: list[dict], settings: dict, provenance: dict) -> None:
    """Write ``samples`` (any subset of a generation, in index order) to ``path`` (.npz) and
    ``<path without .npz>.json``. Refuses to replace a stored file of other settings."""
    import numpy as np
    _check_distill_settings(path, settings)
    meta_path = _distill_json(path)
    samples = sorted(samples, key=lambda r: r["index"])
    seqs = [r["prompt_ids"] + r["response_ids"] for r in samples]
    top = max((max(q) for q in seqs if q), default=0)
    dt = np.uint16 if top < 1 << 16 else np.uint32
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(q) for q in seqs])
    arrays = {"tokens": np.fromiter((t for q in seqs for t in q), dtype=dt, count=int(offsets[-1])),
              "offsets": offsets,
              "prompt_len": np.array([len(r["prompt_ids"]) for r in samples], dtype=np.int32),
              "index": np.array([r["index"] for r in samples], dtype=np.int32),
              "eos": np.array([r["finish"] == "eos" for r in samples], dtype=np.bool_)}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp.npz"
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)
    _write_json(meta_path, {"settings": settings, "num_samples": len(samples),
                            "prompt_tokens": int(arrays["prompt_len"].sum()),
                            "response_tokens": int(offsets[-1] - arrays["prompt_len"].sum()),
                            **provenance})


def load_distill(path: str) -> tuple[list[dict], dict]:
    """(the samples, the JSON beside them) of a file ``save_distill`` wrote."""
    import numpy as np
    with open(_distill_json(path)) as f:
        meta = json.load(f)
    with np.load(path) as z:
        tokens, off, plen, index, eos = (z[k] for k in ("tokens", "offsets", "prompt_len", "index", "eos"))
    out = []
    for j in range(len(index)):
        q = tokens[off[j]:off[j + 1]].tolist()
        p = int(plen[j])
        out.append({"index": int(index[j]), "prompt_ids": q[:p], "response_ids": q[p:],
                    "finish": "eos" if eos[j] else "length"})
    return out, meta


def continued(paths: list[str]) -> list[str]:
    """Of stored generations (.npz with their .json), those another, complete one continues (its
    settings "extends" their key, ``--extend-data``): the longer answers stand for them in a mix. A
    continuation still under way stands for nothing (the answers it has not reached are the
    shorter generation's)."""
    metas = {p: json.load(open(_distill_json(p))) for p in paths}
    keys = {sha1(m.get("settings")): p for p, m in metas.items()}
    ext = {(m.get("settings") or {}).get("extends", {}).get("settings_key") for m in metas.values()
           if (m.get("info") or {}).get("complete")}
    return [p for k, p in keys.items() if k in ext]


def unfinished_continuations(paths: list[str]) -> list[str]:
    """Of stored generations, the continuations (``--extend-data``) not complete yet: mixed beside
    the generation they continue they would repeat its answers, so the shorter one stands for both."""
    out = []
    for p in paths:
        m = json.load(open(_distill_json(p)))
        if (m.get("settings") or {}).get("extends") and not (m.get("info") or {}).get("complete"):
            out.append(p)
    return out


def load_mix(paths: list[str], gen_dir: str, held: list[dict]) -> tuple[list[dict], list[dict]]:
    """The samples of stored generations (``--mix-data``) that join a run's train split: their
    samples in file order, each tagged with its file (``"mix"``: position in ``paths``), and one
    record per file (path, its generation settings' key, samples taken, samples dropped).
    Samples whose prompt is one of the held-out samples' prompts are dropped (the held-out split
    stays unseen). Refused (ValueError naming the option and file): a missing file, a file that
    is the run's own generation (``gen_dir``), the same file twice."""
    held_prompts = {tuple(s["prompt_ids"]) for s in held}
    own = os.path.basename(gen_dir).removeprefix("gen-")
    out, records, keys = [], [], set()
    for k, path in enumerate(paths):
        if not os.path.isfile(path) or not os.path.isfile(_distill_json(path)):
            raise ValueError(f"--mix-data {path!r}: no such stored generation (a .npz with its .json "
                             f"beside it, as --distill-data writes)")
        samples, meta = load_distill(path)
        key = sha1(meta.get("settings"))
        if key == own:
            raise ValueError(f"--mix-data {path!r} is the generation this run trains on already "
                             f"(its settings are this run's); leave it out")
        if key in keys:
            raise ValueError(f"--mix-data {path!r}: the same generation is given twice")
        keys.add(key)
        kept = [{**s, "mix": k} for s in samples if tuple(s["prompt_ids"]) not in held_prompts]
        out += kept
        records.append({"file": os.path.basename(path), "settings_key": key, "samples": len(kept),
                        "dropped_held_out_prompts": len(samples) - len(kept),
                        "response_tokens": sum(len(s["response_ids"]) for s in kept)})
        log(f"generation: --mix-data {path}: {len(kept)} samples join the train split"
            + (f" ({len(samples) - len(kept)} dropped: their prompts are held out)"
               if len(kept) < len(samples) else ""))
    return out, records


def _settings_diff(a: dict | None, b: dict) -> str:
    a = a or {}
    keys = sorted(set(a) | set(b), key=str)
    return ", ".join(f"{k}: stored {a.get(k)!r}, this run {b.get(k)!r}" for k in keys if a.get(k) != b.get(k))


def seed_generation(path: str, gen_dir: str, settings: dict) -> int:
    """Samples stored in ``path`` with these ``settings`` join the generation folder's (those it
    lacks); returns how many samples the file holds (0: none stored yet). Another generation's
    file is refused (ValueError naming it)."""
    if not os.path.isfile(path):
        return 0
    _check_distill_settings(path, settings)
    stored, _ = load_distill(path)
    os.makedirs(gen_dir, exist_ok=True)
    samples_path = os.path.join(gen_dir, "samples.jsonl")
    have = read_samples(samples_path)  # the valid ones (a torn last line is dropped here)
    known = {r["index"] for r in have}
    new = [r for r in stored if r["index"] not in known]
    if new:
        with open(samples_path + ".tmp", "w") as f:
            for r in have + new:
                f.write(json.dumps(r) + "\n")
        os.replace(samples_path + ".tmp", samples_path)
        log(f"generation: {len(new)} samples from {path}")
    return len(stored)


ENGINE_CALL_BATCHES = 4  # --gen-engine batched: requests per Engine.generate call, in --gen-batch-size units
EXTEND_SAME = ("data_sha1", "num_prompts", "max_prompt_tokens", "truncate", "seed", "temperature")


def load_extended(path: str, settings: dict) -> tuple[dict[int, dict], dict]:
    """``--extend-data``: (sample index -> stored sample, the stored settings) of a generation whose
    answers a longer one continues. Refused (ValueError naming the option and what differs): a
    missing file, other prompts, limits, seed or temperature, a length limit not below this one."""
    if not os.path.isfile(path) or not os.path.isfile(_distill_json(path)):
        raise ValueError(f"--extend-data {path!r}: no such stored generation (a .npz with its .json beside it, "
                         f"as --distill-data writes)")
    samples, meta = load_distill(path)
    stored = meta.get("settings") or {}
    diff = [k for k in EXTEND_SAME if stored.get(k) != settings.get(k)]
    if diff:
        raise ValueError(f"--extend-data {path!r} answered other prompts or with other settings "
                         f"({_settings_diff({k: stored.get(k) for k in diff}, {k: settings.get(k) for k in diff})}); "
                         f"a generation can only continue one of the same prompts, limits, seed and temperature")
    if not isinstance(stored.get("max_new_tokens"), int) or stored["max_new_tokens"] >= settings["max_new_tokens"]:
        raise ValueError(f"--extend-data {path!r} has max_new_tokens {stored.get('max_new_tokens')!r}; this run's "
                         f"--max-new-tokens ({settings['max_new_tokens']}) must be larger to continue it")
    return {r["index"]: r for r in samples}, stored


def sample_seed(seed: int, index: int, start: int = 0) -> int:
    """The generator seed of sample ``index`` of a sampled generation with ``--seed`` ``seed``;
    ``start`` > 0: of its continuation after ``start`` stored tokens (``--extend-data``: draws of
    their own, not the stored part's again)."""
    key = f"{seed}:{index}" if not start else f"{seed}:{index}:{start}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def _generate(encode, prompts, gen_dir, settings, batch_size, answer, stop_at=None, base=None, per_call=1):
    """``answer(prompts, max_new_tokens list, seeds)`` -> [(response ids, finish)], called with
    ``per_call`` batches at a time (the batched engine refills its slots from them as answers end);
    ``base``: the stored samples a longer generation continues (``load_extended``)."""
    from tqdm import tqdm
    num_prompts, max_new_tokens = settings["num_prompts"], settings["max_new_tokens"]
    temperature = settings.get("temperature", 0.0)
    max_prompt_tokens, seed, truncate = settings["max_prompt_tokens"], settings["seed"], settings["truncate"]
    meta_path, samples_path = os.path.join(gen_dir, "meta.json"), os.path.join(gen_dir, "samples.jsonl")
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("complete") and meta.get("settings") == settings:
            samples = sorted(read_samples(samples_path), key=lambda s: s["index"])
            if len(samples) == meta["num_samples"]:
                log(f"generation: re-using {len(samples)} samples in {gen_dir}")
                return gen_dir, samples, {"generated": 0, "reused": len(samples), "complete": True,
                                          **meta["info"]}
    os.makedirs(gen_dir, exist_ok=True)
    t0 = time.perf_counter()
    encoded, skipped = select_prompts(prompts, encode, num_prompts, max_prompt_tokens, seed, truncate)
    if num_prompts and len(encoded) < num_prompts:
        log(f"generation: only {len(encoded)} of --num-prompts {num_prompts} prompts fit "
             f"--max-prompt-tokens {max_prompt_tokens}")
    done = {s["index"]: s for s in read_samples(samples_path)}
    if any(i >= len(encoded) or s["prompt_ids"] != encoded[i] for i, s in done.items()):
        done = {}  # not ours: start over
    with open(samples_path, "w") as f:  # rewrite what is valid (drops a torn last line)
        for i in sorted(done):
            f.write(json.dumps(done[i]) + "\n")
    # batches of similar prompt lengths (little padding), run in a random order (an honest ETA)
    todo = sorted((i for i in range(len(encoded)) if i not in done), key=lambda i: len(encoded[i]))
    mean_len = sum(map(len, encoded)) / len(encoded)
    log(f"generation: {len(encoded)} prompts (mean {mean_len:.0f} tokens, {skipped} skipped as longer "
         f"than --max-prompt-tokens), up to {max_new_tokens} new tokens each, batches of {batch_size}, "
         + (f"sampled at temperature {temperature}" if temperature else "greedy")
         + (f"; resuming, {len(done)} already done" if done else ""))
    # --extend-data: a stored answer (of the same prompt) ended by EOS is kept as it is; one cut at
    # its length limit is continued from its own tokens (the prompt of the continuation)
    prior: dict[int, list[int]] = {}
    if base is not None:
        kept = 0
        with open(samples_path, "a") as f:
            for i in list(todo):
                b = base.get(i)
                if b is None:
                    continue
                if b["prompt_ids"] != encoded[i]:
                    raise ValueError(f"--extend-data: its sample {i} answers another prompt than this run's "
                                     f"sample {i} (another prompt file or selection)")
                if b["finish"] == "eos" or len(b["response_ids"]) >= max_new_tokens:
                    rec = {"index": i, "prompt_ids": encoded[i], "response_ids": b["response_ids"][:max_new_tokens],
                           "finish": b["finish"]}
                    done[i] = rec
                    f.write(json.dumps(rec) + "\n")
                    kept += 1
                else:
                    prior[i] = b["response_ids"]
        todo = [i for i in todo if i not in done]
        log(f"generation: --extend-data: {kept} stored answers kept as they are, {len(prior)} to continue")
    batches = [todo[s:s + batch_size * per_call] for s in range(0, len(todo), batch_size * per_call)]
    random.Random(seed).shuffle(batches)
    new_tokens = 0
    with open(samples_path, "a") as f, tqdm(total=len(encoded), initial=len(done), unit="prompt",
                                             desc="generate", **BAR) as bar:
        for idx in batches:
            if stop_at is not None and time.perf_counter() >= stop_at:
                break
            heads = [prior.get(i, []) for i in idx]
            results = answer([encoded[i] + h for i, h in zip(idx, heads)], [max_new_tokens - len(h) for h in heads],
                             [sample_seed(seed, i, len(h)) for i, h in zip(idx, heads)])
            for i, h, (resp, fin) in zip(idx, heads, results):
                rec = {"index": i, "prompt_ids": encoded[i], "response_ids": h + resp, "finish": fin}
                done[i] = rec
                f.write(json.dumps(rec) + "\n")
                new_tokens += len(resp)
            f.flush()
            bar.update(len(idx))
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
    samples = [done[i] for i in sorted(done)]
    complete = len(samples) == len(encoded)
    info = {"prompts": len(encoded), "skipped_prompts": skipped,
            "prompt_tokens": sum(len(s["prompt_ids"]) for s in samples),
            "response_tokens": sum(len(s["response_ids"]) for s in samples),
            "finished_by_eos": sum(s["finish"] == "eos" for s in samples),
            "seconds": round(time.perf_counter() - t0, 1)}
    if not complete:
        log(f"generation: stopped (the time limit, or --no-generate) with {len(samples)} of {len(encoded)} "
            f"samples "
            f"({info['response_tokens']} response tokens in {info['seconds']} s); a later run resumes")
        return gen_dir, samples, {"generated": len(samples) - (len(encoded) - len(todo)),
                                  "reused": len(encoded) - len(todo), "complete": False, **info}
    _write_json(meta_path, {"settings": settings, "complete": True, "num_samples": len(samples),
                            "info": info})
    log(f"generation: {info['response_tokens']} response tokens in {info['seconds']} s -> {gen_dir}")
    return gen_dir, samples, {"generated": len(todo), "reused": len(encoded) - len(todo), "complete": True,
                              **info}


# ---------------------------------------------------------------------------------------------
# Stage 2: features
FEATURE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def split(samples: list[dict], eval_samples: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out): the last ``eval_samples`` samples are held out, leaving at least one to train on."""
    n_eval = min(eval_samples, len(samples) - 1) if len(samples) > 1 else 0
    return samples[:len(samples) - n_eval], samples[len(samples) - n_eval:]


@torch.inference_mode()
def _label_rows(logits: Tensor, topk: int) -> dict[str, Tensor]:
    """The labels of positions from their logits [n, V]: the argmax (of the logits as they are: a
    16-bit model's in float32 have the same argmax, widening is exact) and, with ``topk`` > 0, the
    top-k ids and their log-probabilities (log-softmax in float32 over the whole vocabulary)."""
    out = {"argmax": logits.argmax(-1).to(torch.int32).cpu()}
    if topk:
        logp, ids = torch.log_softmax(logits.float(), -1).topk(topk, dim=-1)
        out.update(topk_ids=ids.to(torch.int32).cpu(), topk_logp=logp.float().cpu())
    return out


def _sample_tensors(target: Transformer, sample: dict, spec, cache, fdtype: torch.dtype, topk: int = 0) -> dict:
    ids = sample["prompt_ids"] + sample["response_ids"]
    n = len(ids)
    x = torch.tensor([ids], dtype=torch.int64, device=target.device)
    logits, feats = target.forward(x, torch.arange(n, device=target.device)[None], cache, 0,
                                   logits="all", features=spec)
    return {"features": feats[0].to(fdtype).cpu(), "ids": torch.tensor(ids, dtype=torch.int32),
            **_label_rows(logits[0].float(), topk)}


@torch.inference_mode()
def _batch_tensors(target: Transformer, group: list[dict], spec, fdtype: torch.dtype, topk: int = 0) -> list[dict]:
    """``_sample_tensors`` of several samples in one forward: right-padded to the longest (causal
    attention: a token never sees the padding after it), the LM head and argmax per sample on its
    own rows. On CPU every token's numbers are those of the sample alone (the kernels reduce in one
    order per row); on CUDA the GEMMs may round differently with the batch size."""
    seqs = [s["prompt_ids"] + s["response_ids"] for s in group]
    n, dev = max(map(len, seqs)), target.device
    x = torch.zeros(len(seqs), n, dtype=torch.int64)
    for b, q in enumerate(seqs):
        x[b, :len(q)] = torch.tensor(q, dtype=torch.int64)
    pos = torch.arange(n, device=dev)[None].expand(len(seqs), n)
    normed, feats = target.forward(x.to(dev), pos, target.new_cache(n, len(seqs)), 0, logits="normed",
                                   features=spec)
    out = []
    for b, q in enumerate(seqs):
        L = len(q)
        parts = [_label_rows(target.lm_head(normed[b, s:min(s + 512, L)]), topk) for s in range(0, L, 512)]
        out.append({"features": feats[b, :L].to(fdtype).cpu(), "ids": torch.tensor(q, dtype=torch.int32),
                    **{k: torch.cat([p[k] for p in parts]) for k in parts[0]}})
    return out


def _pack(rows: list[dict], samples: list[dict]) -> dict[str, Tensor]:
    lens = [r["ids"].numel() for r in rows]
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lens).cumsum(0)
    labels = [k for k in ("argmax", "topk_ids", "topk_logp") if k in rows[0]]
    return {"features": torch.cat([r["features"] for r in rows]).contiguous(),
            "ids": torch.cat([r["ids"] for r in rows]), **{k: torch.cat([r[k] for r in rows]) for k in labels},
            "offsets": offsets,
            "prompt_len": torch.tensor([len(s["prompt_ids"]) for s in samples], dtype=torch.int64)}


def collect_features(target: Transformer, gen_dir: str, samples: list[dict], work_dir: str, spec, *,
                     eval_samples: int, shard_tokens: int, feature_dtype: str, complete_gen: bool = True,
                     stop_at: float | None = None, batch_size: int = 1,
                     other_answerer: bool = False, mix: list[dict] | None = None,
                     topk: int = 0) -> tuple[str, dict]:
    """Stage 2. Returns (the feature folder, its manifest). ``other_answerer``: the samples were
    answered by another model than ``target`` (a --gen-dtype copy), so ``target``'s fingerprint
    joins the folder's key. ``complete_gen`` False: ``samples`` are the part of the generation
    done so far (their indices key the folder). ``stop_at`` (a
    ``time.perf_counter()`` value): the shard in progress is written and the stage returns once it
    has passed; the manifest lists the shards done (not "complete") and a later call resumes.
    ``batch_size``: samples per target forward (``_batch_tensors``), taken by similar length from
    windows of up to 32 batches (``_window``) and stored in sample order. ``mix``: the records of ``load_mix`` when
    ``samples`` hold other generations' samples too (tagged ``"mix"``); they join the key.
    ``topk`` > 0: the target's top-k next tokens and log-probabilities are stored too (a key of
    their own)."""
    spec_key = "final" if spec == "final" else [int(i) for i in spec]
    settings = dict(gen=os.path.basename(gen_dir), spec=spec_key, eval_samples=eval_samples,
                    shard_tokens=shard_tokens, feature_dtype=feature_dtype, version=1)
    if not complete_gen:
        settings["subset"] = sha1([s["index"] for s in samples] if not mix else
                                  [[s.get("mix", -1), s["index"]] for s in samples])
    if mix:
        settings["mix"] = [[m["settings_key"], m["samples"]] for m in mix]
    if topk:  # absent otherwise: the keys of feature folders without soft labels stay valid
        settings["topk"] = int(topk)
    if other_answerer:  # another model answered (--gen-dtype): the features' target joins the key
        settings["target"] = target_fingerprint(target)
    if target.matmuls != "kernels":  # (use_torch_matmuls) absent otherwise: the older folders' keys stay valid
        settings["matmuls"] = [target.matmuls, str(target.dtype).removeprefix("torch.")]
    feat_dir = os.path.join(work_dir, f"feat-{sha1(settings)}")
    with stage_lock(feat_dir):
        return _collect(target, samples, feat_dir, settings, spec, stop_at, batch_size)


def _tensors_in_order(target, group: list[dict], spec, fdtype, batch_size: int, topk: int = 0) -> list[dict]:
    """``_sample_tensors`` of ``group``, in its order, computed ``batch_size`` samples of similar
    length at a time."""
    if batch_size <= 1:
        cache = target.new_cache(max(len(s["prompt_ids"]) + len(s["response_ids"]) for s in group))
        return [_sample_tensors(target, s, spec, cache, fdtype, topk) for s in group]
    order = sorted(range(len(group)), key=lambda j: len(group[j]["prompt_ids"]) + len(group[j]["response_ids"]))
    rows: list[dict | None] = [None] * len(group)
    for k in range(0, len(order), batch_size):
        part = order[k:k + batch_size]
        for j, r in zip(part, _batch_tensors(target, [group[j] for j in part], spec, fdtype, topk)):
            rows[j] = r
    return rows


def _collect(target, samples, feat_dir, settings, spec, stop_at=None, batch_size=1):
    from tqdm import tqdm
    eval_samples, shard_tokens, feature_dtype = (settings["eval_samples"], settings["shard_tokens"],
                                                 settings["feature_dtype"])
    man_path = os.path.join(feat_dir, "manifest.json")
    manifest = None
    if os.path.isfile(man_path):
        with open(man_path) as f:
            manifest = json.load(f)
        if manifest.get("settings") != settings:
            manifest = None
        elif manifest.get("complete"):
            log(f"features: re-using {manifest['train_samples']} + {manifest['eval_samples']} samples "
                 f"in {feat_dir}")
            return feat_dir, manifest
    os.makedirs(feat_dir, exist_ok=True)
    fdtype = FEATURE_DTYPES[feature_dtype]
    topk = settings.get("topk", 0)
    train, held = split(samples, eval_samples)
    if manifest is None:
        manifest = {"settings": settings, "complete": False, "shards": [], "eval": None,
                    "train_samples": len(train), "eval_samples": len(held), "sumsq": 0.0, "numel": 0,
                    "agree": 0, "agree_n": 0}
    start = manifest["shards"][-1]["end"] if manifest["shards"] else 0
    total_tokens = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    width = target.cfg.hidden_size * (1 if spec == "final" else len(spec))
    mib = total_tokens * width * fdtype.itemsize / 2**20
    log(f"features: {len(train)} train + {len(held)} eval samples, {total_tokens} tokens, "
         f"{width} {feature_dtype} values per token (~{mib:.0f} MiB)"
         + (f"; resuming at sample {start}" if start else ""))
    t0 = time.perf_counter()
    done_tokens = 0

    def record(rows, group):
        for r, s in zip(rows, group):
            f = r["features"].float()
            manifest["sumsq"] += float(f.pow(2).sum())
            manifest["numel"] += f.numel()
            p, n = len(s["prompt_ids"]), r["ids"].numel()
            manifest["agree"] += int((r["argmax"][p - 1:n - 1] == r["ids"][p:]).sum())
            manifest["agree_n"] += n - p

    def write(name, rows, group):
        path = os.path.join(feat_dir, name)
        save_file(_pack(rows, group), path + ".tmp")
        os.replace(path + ".tmp", path)

    with tqdm(total=total_tokens, unit="tok", desc="features", unit_scale=True, **BAR) as bar:
        if manifest["eval"] is None and held:
            rows = _tensors_in_order(target, held, spec, fdtype, batch_size, topk)
            record(rows, held)
            write("eval.safetensors", rows, held)
            manifest["eval"] = {"file": "eval.safetensors", "lengths": [r["ids"].numel() for r in rows],
                                "prompt_lens": [len(s["prompt_ids"]) for s in held]}
            _write_json(man_path, manifest)
        skip = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in held + train[:start])
        bar.update(skip)
        rows, group = [], []
        i = start
        window: list[dict] = []  # computed ahead, a window at a time (a deadline waits for it)
        while i < len(train):
            s = train[i]
            if not window:
                ahead = 1 if batch_size <= 1 else _window(train, i, batch_size, shard_tokens)
                window = _tensors_in_order(target, train[i:i + ahead], spec, fdtype, batch_size, topk)
            rows.append(window.pop(0))
            group.append(s)
            n = rows[-1]["ids"].numel()
            done_tokens += n
            bar.update(n)
            bar.set_postfix(tok_s=f"{done_tokens / (time.perf_counter() - t0):.0f}")
            i += 1
            late = stop_at is not None and time.perf_counter() >= stop_at and not window
            if sum(r["ids"].numel() for r in rows) >= shard_tokens or i == len(train) or late:
                k = len(manifest["shards"])
                record(rows, group)
                write(f"train-{k:05d}.safetensors", rows, group)
                manifest["shards"].append({"file": f"train-{k:05d}.safetensors", "start": i - len(rows),
                                           "end": i, "lengths": [r["ids"].numel() for r in rows],
                                           "prompt_lens": [len(g["prompt_ids"]) for g in group]})
                _write_json(man_path, manifest)
                rows, group = [], []
                if late and i < len(train):
                    _summarize(manifest, t0)
                    _write_json(man_path, manifest)
                    log(f"features: stopped at the time limit after {i} of {len(train)} train samples "
                        f"({done_tokens} tokens in {manifest['seconds']} s); a later run resumes")
                    return feat_dir, manifest
    manifest["complete"] = True
    _summarize(manifest, t0)
    _write_json(man_path, manifest)
    log(f"features: done in {manifest['seconds']} s; the target's argmax equals the generated token at "
         f"{100 * manifest['argmax_agreement']:.2f}% of response positions -> {feat_dir}")
    return feat_dir, manifest


def _window(train: list[dict], i: int, batch_size: int, shard_tokens: int) -> int:
    """How many samples from ``train[i]`` on are computed together: batches are taken from them by
    similar length, so the wider the window the less padding (on the greedy answers to the training
    prompts, batches of 8: 77 % of the computed rows are real tokens with windows of 4 batches, 97 %
    with 32). Up to 32 batches, and no more tokens than a shard (``--shard-tokens`` bounds memory)
    but at least one batch."""
    n, tokens = 0, 0
    while i + n < len(train) and n < 32 * batch_size:
        t = len(train[i + n]["prompt_ids"]) + len(train[i + n]["response_ids"])
        if n >= batch_size and tokens + t > shard_tokens:
            break
        n, tokens = n + 1, tokens + t
    return n


def _summarize(manifest: dict, t0: float) -> None:
    """The manifest's figures over the shards written so far: feature RMS, argmax agreement, time."""
    manifest["feature_rms"] = (manifest["sumsq"] / max(manifest["numel"], 1)) ** 0.5
    manifest["argmax_agreement"] = manifest["agree"] / max(manifest["agree_n"], 1)
    manifest["seconds"] = round(time.perf_counter() - t0, 1)


def read_manifest(feat_dir: str) -> dict:
    """The manifest of a feature folder; a clear error when there is none."""
    path = os.path.join(feat_dir, "manifest.json")
    if not os.path.isfile(path):
        raise ValueError(f"{feat_dir!r} is not a feature folder (no manifest.json in it)")
    with open(path) as f:
        return json.load(f)


def check_extra_features(feat_dir: str, manifest: dict, spec, feature_dtype: str, topk: int,
                         own_dir: str) -> None:
    """Refuses an --extra-features folder that cannot join this run's features: unfinished, the
    run's own folder, other feature layers or dtype, or without the soft labels --distill-topk
    needs. That the same target computed it is checked on its numbers (``check_same_target``)."""
    name = f"--extra-features {feat_dir!r}"
    st = manifest.get("settings", {})
    if os.path.realpath(feat_dir) == os.path.realpath(own_dir):
        raise ValueError(f"{name} is this run's own feature folder")
    if not manifest.get("complete"):
        raise ValueError(f"{name}: its features are unfinished (the run that extracts them has not completed); "
                         f"finish it first")
    spec_key = "final" if spec == "final" else [int(i) for i in spec]
    if st.get("spec") != spec_key:
        raise ValueError(f"{name} holds features of layers {st.get('spec')}; this head reads {spec_key}")
    if st.get("feature_dtype") != feature_dtype:
        raise ValueError(f"{name} stores {st.get('feature_dtype')} features; this run's --feature-dtype is "
                         f"{feature_dtype}")
    if topk and st.get("topk", 0) < topk:
        raise ValueError(f"{name} stores {'no soft labels' if not st.get('topk') else 'top-' + str(st['topk'])}; "
                         f"--distill-topk {topk} needs the top {topk}")
    if not manifest.get("shards"):
        raise ValueError(f"{name} has no train samples")


@torch.inference_mode()
def check_same_target(target: Transformer, feat_dir: str, manifest: dict, spec, fdtype: torch.dtype,
                      tol: float = 2e-2) -> float:
    """Recomputes the first train sample of a feature folder with ``target`` and compares: the
    stored features must match to ``tol`` relative RMS (another device or kernel rounds
    differently; another model, layer or weight file is off by O(1)) and the stored labels at
    >= 99 % of positions (a near-tie may flip on another device). Returns the relative RMS difference."""
    from safetensors import safe_open
    first = manifest["shards"][0]
    with safe_open(os.path.join(feat_dir, first["file"]), framework="pt") as f:
        off = f.get_slice("offsets")[0:2]
        e = int(off[1])
        ids = f.get_slice("ids")[0:e].tolist()
        stored = f.get_slice("features")[0:e].float()
        argmax = f.get_slice("argmax")[0:e]
    p = first["prompt_lens"][0]
    row = _sample_tensors(target, {"prompt_ids": ids[:p], "response_ids": ids[p:]}, spec,
                          target.new_cache(len(ids)), fdtype)
    mine = row["features"].float()
    if mine.shape != stored.shape:
        raise ValueError(f"--extra-features {feat_dir!r}: its features are {stored.shape[1]} wide, this "
                         f"target's {mine.shape[1]}")
    rel = float((mine - stored).pow(2).mean().sqrt() / stored.pow(2).mean().sqrt().clamp_min(1e-30))
    agree = float((row["argmax"] == argmax).float().mean())
    if not rel <= tol or agree < 0.99:
        raise ValueError(f"--extra-features {feat_dir!r} was not computed by this target: its first sample "
                         f"recomputed differs by {rel:.3g} relative RMS in the features (at most {tol:g} "
                         f"allowed) and agrees with its labels at {100 * agree:.1f}% of positions")
    return rel


def response_counts(feat_dir: str, manifest: dict, vocab: int) -> Tensor:
    """How often each token is a response token in a feature folder's train shards (the ids after
    each sample's prompt), read without loading the features."""
    from safetensors import safe_open
    counts = torch.zeros(vocab, dtype=torch.int64)
    for sh in manifest["shards"]:
        with safe_open(os.path.join(feat_dir, sh["file"]), framework="pt") as f:
            ids, off = f.get_tensor("ids").long(), f.get_tensor("offsets")
        keep = torch.ones(ids.numel(), dtype=torch.bool)
        for s, p in enumerate(sh["prompt_lens"]):
            keep[int(off[s]):int(off[s]) + p] = False
        counts += torch.bincount(ids[keep], minlength=vocab)[:vocab]
    return counts


class FeatureStore:
    """Reads a feature folder: batch plans from the manifest alone, one train shard in memory at a
    time (memory stays bounded by --shard-tokens), the eval split loaded once. ``extra``: other
    folders ``[(dir, manifest)]`` whose train shards join (--extra-features); the eval split stays
    this folder's."""

    def __init__(self, feat_dir: str, manifest: dict, extra: list[tuple[str, dict]] = ()):
        self.dir, self.manifest = feat_dir, manifest
        self.shards = [dict(sh, dir=d) for d, m in [(feat_dir, manifest), *extra] for sh in m["shards"]]
        self._cached: tuple[int, dict] | None = None

    def num_train_samples(self) -> int:
        return sum(len(s["lengths"]) for s in self.shards)

    def load(self, shard: int) -> dict[str, Tensor]:
        if self._cached is None or self._cached[0] != shard:
            self._cached = None
            sh = self.shards[shard]
            self._cached = (shard, load_file(os.path.join(sh["dir"], sh["file"])))
        return self._cached[1]

    def plan(self, batch_size: int, seed: int, epoch: int) -> list[tuple[int, list[int]]]:
        """One epoch's batches [(shard, sample indices)], deterministic in (seed, epoch): shards in a
        random order; inside a shard samples shuffled, grouped by similar length (less padding)
        in windows of 8 batches, the batches shuffled."""
        rng = random.Random(seed * 1_000_003 + epoch)
        out = []
        order = list(range(len(self.shards)))
        rng.shuffle(order)
        for sh in order:
            lengths = self.shards[sh]["lengths"]
            idx = list(range(len(lengths)))
            rng.shuffle(idx)
            batches = []
            win = batch_size * 8
            for w in range(0, len(idx), win):
                chunk = sorted(idx[w:w + win], key=lambda i: lengths[i])
                batches += [chunk[b:b + batch_size] for b in range(0, len(chunk), batch_size)]
            rng.shuffle(batches)
            out += [(sh, b) for b in batches]
        return out

    def eval_batches(self, batch_size: int) -> list[dict]:
        ev = self.manifest.get("eval")
        if not ev:
            return []
        t = load_file(os.path.join(self.dir, ev["file"]))
        n = len(ev["lengths"])
        order = sorted(range(n), key=lambda i: ev["lengths"][i])
        return [collate(t, order[b:b + batch_size]) for b in range(0, n, batch_size)]


def collate(t: dict[str, Tensor], idx: list[int]) -> dict[str, Tensor]:
    """Samples ``idx`` of a shard as a right-padded batch:
    features [B, n, F] (stored dtype), ids [B, n] int64 (pad 0), argmax [B, n] int64 (pad -100),
    prompt_len [B], length [B]; with soft labels stored also topk_ids [B, n, K] int64 (pad 0) and
    topk_logp [B, n, K] float32 (pad -inf)."""
    off = t["offsets"]
    lens = [int(off[i + 1] - off[i]) for i in idx]
    n, bsz = max(lens), len(idx)
    feats = torch.zeros(bsz, n, t["features"].shape[1], dtype=t["features"].dtype)
    ids = torch.zeros(bsz, n, dtype=torch.int64)
    am = torch.full((bsz, n), -100, dtype=torch.int64)
    soft = "topk_ids" in t
    if soft:
        k = t["topk_ids"].shape[1]
        tk_ids = torch.zeros(bsz, n, k, dtype=torch.int64)
        tk_logp = torch.full((bsz, n, k), float("-inf"), dtype=torch.float32)
    for b, i in enumerate(idx):
        s, e = int(off[i]), int(off[i + 1])
        feats[b, :e - s] = t["features"][s:e]
        ids[b, :e - s] = t["ids"][s:e]
        am[b, :e - s] = t["argmax"][s:e]
        if soft:
            tk_ids[b, :e - s] = t["topk_ids"][s:e]
            tk_logp[b, :e - s] = t["topk_logp"][s:e]
    out = {"features": feats, "ids": ids, "argmax": am, "prompt_len": t["prompt_len"][idx].clone(),
           "length": torch.tensor(lens, dtype=torch.int64)}
    if soft:
        out.update(topk_ids=tk_ids, topk_logp=tk_logp)
    return out
