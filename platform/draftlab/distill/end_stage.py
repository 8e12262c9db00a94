"""The end of `draftlab distill` in a fresh process (`BenchSpec.fresh_process`), started by
`finalize.run_fresh`:

    rank 0: save drafter -> python -m draftlab.distill.end_stage REQUEST.json -> RESULT.json

The child loads the target and the saved drafter as users load them, prices the training
curve, and (bench on) chooses, benches and saves the tree (`finalize.curve_and_tree`). Costs timed
in the training worker after training ran markedly high on CPUs; a fresh process times what
`draftlab select-tree` and serving see.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    import datasets  # noqa: PLC0415 -- the child's imports, not the caller's

    from draftlab.config import DistillConfig  # noqa: PLC0415
    from draftlab.data.selfdistill import training_view  # noqa: PLC0415
    from draftlab.distill.drafter_setup import usable_features  # noqa: PLC0415
    from draftlab.distill.finalize import curve_and_tree  # noqa: PLC0415
    from draftlab.models.drafters.build import load_drafter  # noqa: PLC0415
    from draftlab.models.target import load_target  # noqa: PLC0415

    req = json.loads(Path(argv[0]).read_text())
    cfg = DistillConfig.model_validate(req["config"])
    target = load_target(cfg.target.model_copy(update={"device": req["device"]}))
    out_dir = Path(req["drafter_dir"])
    drafter = load_drafter(out_dir, target)
    evalset = None  # read only for the bench (a run without it prices the curve alone)
    if cfg.bench.enabled:
        evalset = usable_features(
            training_view(datasets.load_from_disk(req["data_path"]))["eval"], cfg, target, drafter
        )
    curve, report = curve_and_tree(cfg, drafter, target, evalset, req["evaluations"], out_dir)
    Path(req["result"]).write_text(json.dumps({"curve": curve, "report": report}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
