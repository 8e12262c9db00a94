"""`storage_path: s3://...` against a real S3-compatible server on 127.0.0.1 (moto in server
mode): the drafter, tree.json and tree-search.json land in the bucket (never in a local
`s3:` directory), load back from there, and a rerun resumes from the S3 checkpoint."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import boto3
import pytest
import ray
import torch
from moto.server import ThreadedMotoServer
from safetensors.torch import load as load_safetensors

from distill_support import tiny_config
from draftlab.config import BenchSpec, ConfigError, TrainConfig
from draftlab.decoding.tree_files import resolve_tree
from draftlab.distill.launch import run_distill
from draftlab.distill.tree_select import choose_tree_for_run
from draftlab.models.drafters.build import load_drafter
from draftlab.models.target import load_target
from draftlab.storage import exists, local_copy, publish
from mlflow_server import free_port
from ray_support import local_ray

pytestmark = pytest.mark.slow

BUCKET = "draftlab-test"


@pytest.fixture(scope="module")
def s3(tmp_module):
    """A moto S3 server with one bucket; AWS_* point boto3, pyarrow (Ray Train's storage)
    and draftlab at it, set before Ray starts so its workers inherit them. The working
    directory is a fresh one, so a stray local `s3:` directory would show there."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one INFO line per S3 request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    with pytest.MonkeyPatch.context() as mp:
        for var in (
            "AWS_PROFILE",
            "AWS_SESSION_TOKEN",
            "AWS_CONFIG_FILE",
            "AWS_SHARED_CREDENTIALS_FILE",
        ):
            mp.delenv(var, raising=False)
        mp.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        mp.setenv("DRAFTLAB_CACHE", str(tmp_module / "cache"))  # the S3 mirrors
        workdir = tmp_module / "cwd"
        workdir.mkdir()
        mp.chdir(workdir)
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        try:
            with local_ray():
                yield client
        finally:
            server.stop()


def _keys(client, prefix: str) -> set[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"].removeprefix(prefix) for page in pages for o in page.get("Contents", [])}


def _get(client, key: str) -> bytes:
    return client.get_object(Bucket=BUCKET, Key=key)["Body"].read()


def test_distill_to_s3_stores_the_drafter_there_loads_it_back_and_resumes(s3, tmp_module):
    train = dict(
        batch_size=2, lr=3e-3, warmup_steps=2, checkpoint_every=4, eval_every=4, log_every=1
    )
    cfg = tiny_config(
        tmp_module,
        "s3run",
        f"sqlite:///{tmp_module / 'mlflow.db'}",
        storage_path=f"s3://{BUCKET}/runs",
        train=TrainConfig(epochs=1, **train),
    )
    summary = run_distill(cfg, progress=False)
    assert summary["drafter_dir"] == f"s3://{BUCKET}/runs/s3run/drafter"
    stored = _keys(s3, "runs/s3run/drafter/")
    assert {
        "config.json",
        "model.safetensors",
        "tree.json",
        "tree-search.json",
        "training.json",
    } <= stored, stored
    everything = _keys(s3, "")
    assert any(k.startswith("runs/s3run/checkpoint_") for k in everything), sorted(
        everything
    )  # Ray Train's
    # nothing went to a local directory named after the URI, here or in a worker's cwd
    worker_cwd = ray.get(ray.remote(lambda: os.getcwd()).remote())  # a lambda: pickled by value
    for cwd in {Path.cwd(), Path(worker_cwd)}:
        assert not (cwd / "s3:").exists(), cwd

    # the drafter and its tree load back from S3 (through the local mirror)
    target = load_target("tiny-llama")
    drafter = load_drafter(summary["drafter_dir"], target)
    weights = load_safetensors(_get(s3, "runs/s3run/drafter/model.safetensors"))
    name, stored_tensor = next(
        (n, t) for n, t in weights.items() if n in dict(drafter.named_parameters())
    )
    loaded = dict(drafter.named_parameters())[
        name
    ].detach()  # in the target's dtype (bf16 on AMX/AVX512-BF16)
    assert torch.equal(loaded, stored_tensor.to(loaded.dtype))
    saved_tree = json.loads(_get(s3, "runs/s3run/drafter/tree.json"))
    tree = resolve_tree(None, summary["drafter_dir"], cfg.drafter.k)
    assert [list(p) for p in tree.paths] == (
        saved_tree["paths"] if isinstance(saved_tree, dict) else saved_tree
    )
    # `draftlab select-tree` on the S3 drafter stores its new report beside it
    report = choose_tree_for_run(cfg)
    assert json.loads(_get(s3, "runs/s3run/drafter/tree-search.json")) == report

    # same name + storage_path: Ray Train resumes from the S3 checkpoint, and the new
    # drafter replaces the old one there (and in the mirror)
    longer = cfg.model_copy(
        update={"train": TrainConfig(epochs=2, **train), "bench": BenchSpec(enabled=False)}
    )  # (the first run stored the tree and its search; this one replaces the weights)
    again = run_distill(longer, progress=False)
    assert again["resumed_from_step"] == summary["steps"] > 0
    assert again["steps"] == 2 * summary["steps"]
    restored = load_safetensors(_get(s3, "runs/s3run/drafter/model.safetensors"))[name]
    assert not torch.equal(restored, stored_tensor)  # the stored drafter was replaced
    retrained = dict(load_drafter(again["drafter_dir"], target).named_parameters())[name].detach()
    assert torch.equal(retrained, restored.to(retrained.dtype))  # and the mirror follows it
    assert not (Path.cwd() / "s3:").exists()


def test_local_copy_follows_the_stored_files(s3, tmp_path):
    """The mirror of a URI is refreshed when the stored files change, and files derived
    locally from older ones (or deleted at the URI) do not survive the refresh."""
    uri = f"s3://{BUCKET}/mirror/drafter"
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.json").write_text("1")
    (src / "b.json").write_text("1")
    assert not exists(uri)
    with pytest.raises(FileNotFoundError, match="nothing is stored there"):
        local_copy(uri)
    publish(src, uri)
    assert exists(uri) and _keys(s3, "mirror/drafter/") >= {"a.json", "b.json"}
    mirror = local_copy(uri)
    assert (mirror / "a.json").read_text() == "1"
    (mirror / "derived.json").write_text("from a.json")  # e.g. tree-searched-<n>.json
    assert local_copy(uri) == mirror and (mirror / "derived.json").is_file()  # nothing changed
    s3.put_object(Bucket=BUCKET, Key="mirror/drafter/a.json", Body=b"22")
    s3.delete_object(Bucket=BUCKET, Key="mirror/drafter/b.json")
    mirror = local_copy(uri)
    assert (mirror / "a.json").read_text() == "22"
    assert not (mirror / "b.json").exists() and not (mirror / "derived.json").exists()
    assert local_copy(str(src)) == src  # a local path is used as it is


def test_sweep_refuses_a_uri_storage_path_clearly():
    from draftlab.sweep.runner import _paths

    with pytest.raises(ConfigError, match=r"storage_path 's3://b/x'.*not a URI"):
        _paths({"storage_path": "s3://b/x"}, "sweep")
