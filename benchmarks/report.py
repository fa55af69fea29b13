"""What every benchmark writes with --json: its arguments, the machine, and its rows."""

from __future__ import annotations

import argparse
import json
import platform

import torch


def write_json(path: str, args: argparse.Namespace, **data) -> None:
    """``data`` plus the command's arguments, the processor and the torch version."""
    with open(path, "w") as f:
        json.dump(dict(config=vars(args), machine=platform.processor() or platform.machine(),
                       torch=torch.__version__, **data), f, indent=2)
