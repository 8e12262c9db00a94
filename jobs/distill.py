"""Ray job entrypoint for drafter distillation.

    ray job submit --working-dir . -- python jobs/distill.py -c jobs/configs/smollm2-135m-parallel-k4.yaml
    python jobs/distill.py -c jobs/configs/smollm2-135m-parallel-k4.yaml train.epochs=2 name=my-run
"""

import argparse
import json
import sys

from draftlab.config import ConfigError, DistillConfig, load_yaml, parse_overrides
from draftlab.distill.trainer import run_distill


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--config", required=True, help="DistillConfig YAML")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-4")
    args = parser.parse_args()
    try:
        cfg = load_yaml(DistillConfig, args.config, parse_overrides(args.overrides))
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    summary = run_distill(cfg)
    print(json.dumps({k: v for k, v in summary.items() if k != "bench"}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
