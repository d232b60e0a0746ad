"""The README's Python example runs as written."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_python_example_runs(tmp_path):
    text = README.read_text()
    section = text[text.index("## Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    test_ap, shapes = r.stdout.strip().splitlines()[-2:]
    assert 0.5 < float(test_ap) <= 1
    assert shapes == "torch.Size([59835, 100]) torch.Size([5, 100])"  # every CollegeMsg event; 5 queries
    assert (tmp_path / "runs" / "jodie" / "checkpoints" / "last.pt").exists()
