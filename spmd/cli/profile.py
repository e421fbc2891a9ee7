"""``spmd profile``: time a matmul on each present device and an all-reduce over all; print the profile."""

from __future__ import annotations

import argparse
import json

import jax

from spmd.cli.common import dumps
from spmd.devices import measure

__all__ = ["command"]


def command(args: argparse.Namespace) -> int:
    profile = measure(jax.devices(), size=args.size)
    data = profile.to_dict()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    print(dumps(data))
    return 0
