"""Ray job entrypoint for `draftlab bench` from a YAML config.

    ray job submit --working-dir . -- python jobs/bench.py -c jobs/configs/bench-smollm2-135m.yaml
    python jobs/bench.py -c jobs/configs/bench-smollm2-135m.yaml max_new_tokens=64 target.device=cuda
"""

import argparse
import sys

from draftlab.bench import render_table, run_bench
from draftlab.config import BenchConfig, ConfigError, load_yaml, parse_overrides


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--config", required=True, help="BenchConfig YAML")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. max_new_tokens=64")
    args = parser.parse_args()
    try:
        cfg = load_yaml(BenchConfig, args.config, parse_overrides(args.overrides))
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    print(render_table(run_bench(cfg)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
