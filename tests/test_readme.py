"""The README's first example runs as written."""

from __future__ import annotations

import re
from pathlib import Path


def test_readme_quick_example_runs(capsys):
    text = (Path(__file__).parents[1] / "README.md").read_text()
    first = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    namespace: dict = {}
    exec(compile(first, "README.md", "exec"), namespace)
    assert namespace["W"].grad is not None and namespace["W"].grad.shape == (64, 64)
    assert "bytes saved" in capsys.readouterr().out
