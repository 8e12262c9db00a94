"""The end of `draftlab distill` in a fresh process (`BenchSpec.fresh_process`).

    rank 0: save drafter -> python -m draftlab.distill.end_stage REQUEST.json -> RESULT.json

The child loads the target and the saved drafter as users load them, prices the training
curve, and (bench on) chooses, benches and saves the tree (`finalize.bench_trees`). Costs timed
in the training worker after training ran 20-40% high on CPUs; a fresh process times what
`draftlab select-tree` and serving see.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TAIL = 3000  # characters of the child's stderr quoted in an error


def run_fresh(cfg, out_dir: Path, data_path: str, device: str, evaluations: list[dict]) -> dict:
    """`{"curve": ..., "report": ... | None}` computed by a child process (see module doc)."""
    import draftlab  # noqa: PLC0415 -- its location is the child's import path

    with tempfile.TemporaryDirectory(prefix="draftlab-end-") as work:
        request, result = Path(work) / "request.json", Path(work) / "result.json"
        request.write_text(json.dumps({"config": cfg.model_dump(mode="json"), "drafter_dir": str(out_dir),
                                       "data_path": data_path, "device": device, "evaluations": evaluations,
                                       "result": str(result)}))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(draftlab.__file__).parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])])}
        proc = subprocess.run([sys.executable, "-m", "draftlab.distill.end_stage", str(request)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the end stage's process failed (exit {proc.returncode}):\n{proc.stderr[-TAIL:]}")
        return json.loads(result.read_text())


def main(argv: list[str]) -> int:
    import datasets  # noqa: PLC0415 -- the child's imports, not the caller's

    from draftlab.config import DistillConfig  # noqa: PLC0415
    from draftlab.data.selfdistill import training_view  # noqa: PLC0415
    from draftlab.distill.drafter_setup import usable_features  # noqa: PLC0415
    from draftlab.distill.finalize import bench_trees, training_curve  # noqa: PLC0415
    from draftlab.models.drafters.build import load_drafter  # noqa: PLC0415
    from draftlab.models.target import load_target  # noqa: PLC0415

    req = json.loads(Path(argv[0]).read_text())
    cfg = DistillConfig.model_validate(req["config"])
    target = load_target(cfg.target.model_copy(update={"device": req["device"]}))
    out_dir = Path(req["drafter_dir"])
    drafter = load_drafter(out_dir, target)
    curve = training_curve(cfg, drafter, target, req["evaluations"])
    report = None
    if cfg.bench.enabled:
        evalset = usable_features(training_view(datasets.load_from_disk(req["data_path"]))["eval"], cfg, target, drafter)
        report = bench_trees(cfg, drafter, target, evalset, out_dir)
    Path(req["result"]).write_text(json.dumps({"curve": curve, "report": report}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
