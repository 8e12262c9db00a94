"""The shared shape of every `jobs/*.py` entrypoint: parse `-c CONFIG [key=value ...]`,
validate into a strict config (errors name file and field, exit 2), run one library call."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from pydantic import BaseModel

from draftlab.config import ConfigError, load_yaml, parse_overrides


def run_entrypoint(doc: str, run: Callable[[str, dict], str], argv: list[str] | None = None) -> int:
    """`run(config_path, dotted_overrides)` returns the text to print (a table or summary)."""
    parser = argparse.ArgumentParser(description=doc.strip().split("\n")[0])
    parser.add_argument("-c", "--config", required=True, help="YAML config")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4")
    args = parser.parse_args(argv)
    try:
        print(run(args.config, parse_overrides(args.overrides)))
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


def job_main(
    doc: str, model: type[BaseModel], run: Callable[[BaseModel], str], argv: list[str] | None = None
) -> int:
    """`run(cfg)` returns the text to print, `cfg` the file validated into `model`."""
    return run_entrypoint(doc, lambda path, overrides: run(load_yaml(model, path, overrides)), argv)
