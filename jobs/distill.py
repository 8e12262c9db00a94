r"""Ray job entrypoint for drafter distillation.

ray job submit --working-dir . -- \
    python jobs/distill.py -c jobs/configs/smollm2-135m-parallel-k4.yaml
python jobs/distill.py -c jobs/configs/smollm2-135m-parallel-k4.yaml train.epochs=2 name=my-run
"""

import sys

from draftlab.config import DistillConfig
from draftlab.distill.launch import format_summary, run_distill
from draftlab.entrypoint import job_main

if __name__ == "__main__":
    sys.exit(job_main(__doc__, DistillConfig, lambda cfg: format_summary(run_distill(cfg))))
