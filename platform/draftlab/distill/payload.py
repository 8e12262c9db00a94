"""What the driver hands every Ray Train worker of a distillation (`WorkerPayload`).

    driver (launch.build_trainer):
        TorchTrainer(train_loop_config=WorkerPayload(...).model_dump())
    worker (worker.train_fn_per_worker):
        WorkerPayload.model_validate(config)

Ray Train passes `train_loop_config` to each worker as a plain dict (it is pickled and may be
merged with Tune's), so the model travels dumped and is validated again on the worker side.
"""

from __future__ import annotations

from draftlab.config import DistillConfig, StrictModel


class WorkerPayload(StrictModel):
    """The driver-to-worker payload of one distillation run (`train_loop_config`)."""

    cfg: DistillConfig
    """The validated job configuration."""
    data_path: str
    """The self-distillation dataset's directory (`datasets.load_from_disk`): every worker
    reopens the one the driver generated or reused."""
    mlflow_run_id: str | None = None
    """The MLflow run rank 0 logs into (created or resumed by the driver); None = no logging."""
    tracking_uri: str | None = None
    """The MLflow tracking URI of that run."""
    output_dir: str
    """Where the drafter directory is written: a local path, or (from `train_and_publish`)
    a local staging directory that rank 0 publishes to the job's URI."""
