"""What the probe scripts (``probe_wgrad.py``, ``probe_plain.py``) do with their results."""

from __future__ import annotations

import argparse
import json
import os
from typing import Callable, Optional


def write_and_print(results: dict, out_dir: Optional[str], filename: str) -> None:
    """Saves ``results`` as ``out_dir/filename`` (JSON) where ``out_dir`` is given, and prints them."""
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, filename), "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


def run_and_save(run: Callable[[], dict], description: str, filename: str) -> None:
    """The command line of a one-process probe: ``[--out DIR]``, then ``run()``'s results written and printed."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=None)
    write_and_print(run(), p.parse_args().out, filename)
