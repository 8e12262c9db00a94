"""Ray job entrypoint for `draftlab bench` from a YAML config.

ray job submit --working-dir . -- python jobs/bench.py -c jobs/configs/bench-smollm2-135m.yaml
python jobs/bench.py -c jobs/configs/bench-smollm2-135m.yaml max_new_tokens=64 target.device=cuda
"""

import sys

from draftlab.bench import render_table, run_bench
from draftlab.config import BenchConfig
from draftlab.entrypoint import job_main

if __name__ == "__main__":
    sys.exit(job_main(__doc__, BenchConfig, lambda cfg: render_table(run_bench(cfg))))
