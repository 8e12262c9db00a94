"""Ray job entrypoint for the whole loop (distill -> sweep -> promote -> serve -> smoke).

draftlab submit --address http://HEAD:8265 pipeline -c jobs/configs/pipeline-smollm2-135m-cpu.yaml
python jobs/pipeline.py -c jobs/configs/pipeline-smollm2-135m-cpu.yaml
"""

import sys

from draftlab.entrypoint import run_entrypoint
from draftlab.pipeline.runner import format_summary, run_pipeline

if __name__ == "__main__":
    sys.exit(
        run_entrypoint(
            __doc__, lambda path, overrides: format_summary(run_pipeline(path, overrides))
        )
    )
