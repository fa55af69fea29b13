"""What every benchmark writes with --json: its arguments, the machine, and its rows."""

from __future__ import annotations

import argparse
import json

import torch

from ctxpar.calibrate import machine


def write_json(path: str, args: argparse.Namespace, **data) -> None:
    """``data`` plus the command's arguments, the machine (CPU model, cores: "x86_64" alone once
    named none) and the torch version."""
    with open(path, "w") as f:
        json.dump(dict(config=vars(args), machine=machine(), torch=torch.__version__, **data), f, indent=2)
