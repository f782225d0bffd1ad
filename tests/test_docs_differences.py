"""docs/differences.md quotes the output of its appendix script: the script still prints it."""
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_differences_appendix_reproduces_its_quoted_output(tmp_path):
  text = (REPO / "docs" / "differences.md").read_text()
  appendix = text[text.index("## Appendix"):]
  script = re.search(r"```python\n(.*?)```", appendix, re.S).group(1)
  quoted = re.search(r"Its output:\n\n```\n(.*?)```", appendix, re.S).group(1)
  (tmp_path / "measure.py").write_text(script)
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, str(tmp_path / "measure.py")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.splitlines() == quoted.splitlines()
