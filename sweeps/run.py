"""Ray job entrypoint for sweeps (the same options as `draftlab sweep`).

ray job submit --working-dir . -- python sweeps/run.py -c sweeps/smollm2-135m-cpu.yaml
python sweeps/run.py --resume .draftlab/ray/sweeps/smollm2-135m-cpu
"""

import sys

from draftlab.cli import main

if __name__ == "__main__":
    sys.exit(main(["sweep", *sys.argv[1:]]))
