"""The driver-to-worker payload of a distillation (`WorkerPayload`): Ray Train's
`train_loop_config` stays a plain dict, validated back on the worker side; a URI output
directory becomes a staging directory for the worker (no Ray started)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from distill_support import tiny_config
from draftlab.distill import launch
from draftlab.distill.payload import WorkerPayload


@pytest.fixture
def cfg(tmp_path):
    return tiny_config(tmp_path, "payload", "sqlite:///unused.db")


def test_the_trainer_gets_a_plain_dict_that_validates_back(cfg):
    config = launch.build_trainer(cfg, "/data/cache", "run-1", "sqlite:///t.db").train_loop_config
    assert type(config) is dict and type(config["cfg"]) is dict
    payload = WorkerPayload.model_validate(config)
    assert (
        payload.cfg == cfg
        and payload.data_path == "/data/cache"
        and payload.mlflow_run_id == "run-1"
    )
    assert payload.tracking_uri == "sqlite:///t.db" and payload.output_dir == launch.output_dir(cfg)


def test_a_bad_payload_names_the_field(cfg):
    good = WorkerPayload(cfg=cfg, data_path="d", output_dir="o").model_dump()
    with pytest.raises(ValidationError, match="data_pth"):
        WorkerPayload.model_validate(good | {"data_pth": "d"})
    with pytest.raises(ValidationError, match="output_dir"):
        WorkerPayload.model_validate({k: v for k, v in good.items() if k != "output_dir"})


class _Rank0:
    def get_world_rank(self) -> int:
        return 0


@pytest.mark.parametrize("dest", ["local", "s3://bucket/drafter"])
def test_a_uri_output_dir_is_staged_then_published(cfg, monkeypatch, tmp_path, dest):
    dest = str(tmp_path / dest) if dest == "local" else dest
    seen, published = [], []
    monkeypatch.setattr(launch, "train_fn_per_worker", lambda c: seen.append(c) or {"steps": 1})
    monkeypatch.setattr(launch.ray.train, "get_context", lambda: _Rank0())
    monkeypatch.setattr(launch, "publish", lambda src, to: published.append((src, to)))
    config = WorkerPayload(cfg=cfg, data_path="d", output_dir=dest).model_dump()
    assert launch.train_and_publish(config) == {"steps": 1}
    (passed,) = seen
    staged = WorkerPayload.model_validate(passed)  # what the worker receives: a valid payload
    assert staged.cfg == cfg and staged.data_path == "d"
    if dest.startswith("s3://"):
        assert staged.output_dir != dest and published == [(staged.output_dir, dest)]
    else:
        assert passed is config and published == []
