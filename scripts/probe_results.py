"""What the probe scripts (``probe_wgrad.py``, ``probe_plain.py``) do with their results."""

from __future__ import annotations

import json
import os
from typing import Optional


def write_and_print(results: dict, out_dir: Optional[str], filename: str) -> None:
    """Saves ``results`` as ``out_dir/filename`` (JSON) where ``out_dir`` is given, and prints them."""
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, filename), "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))
