"""Agentic and repeated workloads for ``bench_tau.py`` (issue 35 §4): where suffix decoding should win.

* ``multiturn``: chats of three turns from the Spec-Bench sample's MT-bench part (one conversation
  per MT-bench category, its two turns plus a chained follow-up), each turn resending the whole
  conversation with the model's own earlier answers (what a chat client does). The answers come from
  plain decoding, run turn by turn first; every drafter must reproduce them (greedy speculation is
  exact), so every system sees the same prompts.
* ``codeedit``: a code snippet and an instruction whose answer mostly copies it (rename a variable,
  add type hints, add docstrings, fix a bug, add comments). Snippets: the code blocks of the Spec-Bench
  sample's coding references plus small functions written here; the prompts are built
  deterministically (snippet i gets instructions i and i + 1 of the list below).

Nothing is random and nothing is downloaded.
"""
from __future__ import annotations

import json
import re

FOLLOW_UP = "Summarize your previous answer in three short bullet points."

# small snippets written for this benchmark: (code, a variable to rename, its new name, a bug to fix)
SNIPPETS = [
    ("""def moving_average(values, window):
    result = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
""", "total", "running_sum", "the average is wrong for the first full window when window is 1"),
    ("""def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda x: x[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
""", "merged", "combined", "touching intervals such as [1, 2] and [3, 4] should stay separate"),
    ("""class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        if self.items.get(name, 0) < count:
            raise ValueError("not enough " + name)
        self.items[name] -= count

    def total(self):
        return sum(self.items.values())
""", "items", "stock", "remove leaves items with a count of zero in the dictionary"),
    ("""def parse_config(text):
    config = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=")
        config[key.strip()] = value.strip()
    return config
""", "config", "settings", "a value that contains '=' makes split fail"),
    ("""def binary_search(arr, target):
    lo, hi = 0, len(arr)
    while lo < hi:
        mid = (lo + hi) // 2
        if arr[mid] == target:
            return mid
        if arr[mid] < target:
            lo = mid
        else:
            hi = mid
    return -1
""", "mid", "middle", "lo = mid can loop forever; it should be lo = mid + 1"),
    ("""def word_frequencies(path):
    counts = {}
    with open(path) as f:
        for line in f:
            for word in line.split():
                word = word.lower().strip(".,!?")
                counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda kv: kv[1])
""", "counts", "frequency", "the result should be sorted from the most to the least frequent word"),
    ("""def fibonacci(n):
    a, b = 0, 1
    sequence = []
    for _ in range(n):
        sequence.append(a)
        a, b = b, a + b
    return sequence


def is_prime(n):
    if n < 2:
        return False
    for d in range(2, n):
        if n % d == 0:
            return False
    return True
""", "sequence", "numbers", "is_prime is slow: it should stop at the square root of n"),
]

INSTRUCTIONS = [
    "Rename the variable `{old}` to `{new}` everywhere in this code. Reply with the complete updated code only.",
    "Add Python type hints to every function in this code. Reply with the complete updated code only.",
    "Add a docstring to every function in this code. Reply with the complete updated code only.",
    "Fix this bug: {bug}. Reply with the complete corrected code only.",
    "Add a short comment above each line that is not obvious. Reply with the complete updated code only.",
]


def _reference_snippets(spec_bench: str) -> list[tuple[str, str, str, str]]:
    """Code blocks of the Spec-Bench sample's coding references (first turn's answer), with the first
    assigned name in each as the variable to rename."""
    out = []
    with open(spec_bench) as f:
        for line in f:
            r = json.loads(line)
            if r.get("category") != "coding":
                continue
            for ref in (r.get("reference") or [])[:1]:
                for code in re.findall(r"```(?:\w+)?\n(.*?)```", ref, re.S):
                    m = re.search(r"^\s+(\w+) = ", code, re.M)
                    if m and code.count("\n") <= 30:
                        out.append((code, m.group(1), m.group(1) + "_value",
                                    "the function returns None instead of raising a clear error on empty input"))
    return out


def codeedit_prompts(spec_bench: str, n: int = 20) -> list[dict]:
    """``n`` code-edit prompts [{"id", "category", "prompt"}] (category: the instruction kind)."""
    snippets = _reference_snippets(spec_bench) + SNIPPETS
    kinds = ["rename", "type_hints", "docstrings", "fix_bug", "comments"]
    rows = []
    i = 0
    while len(rows) < n:
        s = i % len(snippets)
        k = (s + i // len(snippets)) % len(INSTRUCTIONS)
        code, old, new, bug = snippets[s]
        text = INSTRUCTIONS[k].format(old=old, new=new, bug=bug) + "\n\n```python\n" + code + "```"
        rows.append({"id": f"codeedit-{i}", "category": kinds[k], "prompt": text})
        i += 1
    return rows


def multiturn_conversations(spec_bench: str, n: int = 8) -> list[dict]:
    """The first ``n`` two-turn (MT-bench) conversations of the sample, one per category first
    (round-robin over categories in file order): [{"id", "category", "turns": [t1, t2, FOLLOW_UP]}]."""
    by_cat: dict[str, list[dict]] = {}
    with open(spec_bench) as f:
        for line in f:
            r = json.loads(line)
            if len(r.get("turns", [])) >= 2:
                by_cat.setdefault(r["category"], []).append(r)
    out, j = [], 0
    while len(out) < n and any(j < len(v) for v in by_cat.values()):
        for cat, v in by_cat.items():
            if j < len(v) and len(out) < n:
                r = v[j]
                out.append({"id": f"{cat}-{r['question_id']}", "category": cat,
                            "turns": list(r["turns"][:2]) + [FOLLOW_UP]})
        j += 1
    return out


def multiturn_prompts(convs: list[dict], answer) -> list[dict]:
    """Each turn of each conversation as a prompt [{"id", "category": "turn<k>", "prompt": messages}],
    in order (a conversation's turns one after another); ``answer(messages)`` gives the assistant's
    reply text (plain decoding), which the next turn's messages carry."""
    rows = []
    for c in convs:
        messages: list[dict] = []
        for k, turn in enumerate(c["turns"], 1):
            messages = messages + [{"role": "user", "content": turn}]
            rows.append({"id": f"{c['id']}-t{k}", "category": f"turn{k}", "prompt": list(messages)})
            messages = messages + [{"role": "assistant", "content": answer(list(messages))}]
    return rows
