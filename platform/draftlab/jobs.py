"""The shared shape of every `jobs/*.py` entrypoint: parse `-c CONFIG [key=value ...]`,
validate into a strict config (errors name file and field, exit 2), run one library call."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from pydantic import BaseModel

from draftlab.config import ConfigError, load_yaml, parse_overrides


def job_main(doc: str, model: type[BaseModel], run: Callable[[BaseModel], str], argv: list[str] | None = None) -> int:
    """`run(cfg)` returns the text to print (a table or JSON summary)."""
    parser = argparse.ArgumentParser(description=doc.strip().split("\n")[0])
    parser.add_argument("-c", "--config", required=True, help=f"{model.__name__} YAML")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4")
    args = parser.parse_args(argv)
    try:
        cfg = load_yaml(model, args.config, parse_overrides(args.overrides))
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    print(run(cfg))
    return 0
