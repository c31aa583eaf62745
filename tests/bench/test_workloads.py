"""bench/workloads.py (bench_tau.py --workload multiturn / codeedit): the prompts are deterministic,
each code edit carries its snippet and one instruction, and each chat turn resends the conversation
with the earlier answers."""
from __future__ import annotations

import importlib.util
import os

import pytest

from helpers import shared_data

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("workloads", os.path.join(ROOT, "bench", "workloads.py"))
workloads = importlib.util.module_from_spec(spec)
spec.loader.exec_module(workloads)


@pytest.fixture(scope="module")
def spec_bench():
    path = shared_data("specbench_dev.jsonl")
    if path is None:
        pytest.skip("../shared/data/specbench_dev.jsonl is not here")
    return path


def test_codeedit_prompts(spec_bench):
    rows = workloads.codeedit_prompts(spec_bench, 20)
    assert rows == workloads.codeedit_prompts(spec_bench, 20)  # deterministic
    assert len(rows) == 20 and len({r["prompt"] for r in rows}) == 20
    assert {r["category"] for r in rows} == {"rename", "type_hints", "docstrings", "fix_bug", "comments"}
    for r in rows:
        assert "```python\n" in r["prompt"] and r["prompt"].endswith("```")
        code = r["prompt"].split("```python\n")[1]
        if r["category"] == "rename":  # the variable to rename is in the snippet
            old = r["prompt"].split("`")[1]
            assert f"{old}" in code
    assert sum(1 for r in rows if "def count_words" in r["prompt"]) >= 1  # Spec-Bench's own code too


def test_multiturn_resends_the_conversation(spec_bench):
    convs = workloads.multiturn_conversations(spec_bench, 8)
    assert len(convs) == 8 and len({c["category"] for c in convs}) == 8  # one per MT-bench category
    answers = []

    def answer(messages):
        answers.append(f"answer {len(answers)}")
        return answers[-1]
    rows = workloads.multiturn_prompts(convs[:2], answer)
    assert [r["category"] for r in rows] == ["turn1", "turn2", "turn3"] * 2
    third = rows[2]["prompt"]
    assert [m["role"] for m in third] == ["user", "assistant", "user", "assistant", "user"]
    assert third[1]["content"] == "answer 0" and third[3]["content"] == "answer 1"
    assert third[-1]["content"] == workloads.FOLLOW_UP and third[0]["content"] == convs[0]["turns"][0]
    assert rows[3]["prompt"] == [{"role": "user", "content": convs[1]["turns"][0]}]  # a new chat starts afresh
